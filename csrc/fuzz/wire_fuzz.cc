// libFuzzer target: the wire-protocol decoders (transport/wire.h), what the serving side does with
// a decoded transfer (Registry::resolve, commitRead, describe), the real serving loop
// (Engine::serveStream over an in-memory stream, against a real Engine), and the requester's checks
// of the answers it reads, fed arbitrary bytes.
//
// Input: one selector byte (fuzz_fixture.h, Mode), then the bytes for that mode. Checked beyond
// "no crash, no sanitizer report, no exception":
//  * a decoder that accepts its input accepted only values within the documented bounds, and
//    re-encoding them gives the same bytes (no field skipped or misread);
//  * an access that Registry::resolve accepts lies inside one tensor of a cache that the registry
//    still holds and that the result keeps alive; a write only inside a remote-accessible cache;
//    the payload size is what payloadBytes() says; every byte of the range can be touched;
//  * a rejected access is kKvCacheNotExist or kParamInvalid, never anything else;
//  * a describe() answer names live tensors of a blocks cache;
//  * the serving loop, on a link that is not same-host, never sends an address of the caches (no
//    8-byte window of its output lies inside a registered tensor), but for the memory table a raw
//    describe answers on any link by design (a whole tensor's start followed by its size: a peer
//    addresses registered memory by address anyway, docs/security.md), and never changes a cache
//    that is not remote accessible;
//  * notifications a peer queues stay within the engine's limit;
//  * an IPC answer the requester accepts leads only to copies inside the spans the server exported;
//  * a UCX worker address that ucx::checkWorkerAddress accepts is one UCX's own reader
//    (ucx_address_model.h, ucp_address_unpack transliterated, no bounds checks) walks to exactly its
//    last byte, never past it (AddressSanitizer guards the buffer's end), reading the same entries,
//    with no endpoint addresses, at most 128 entries, md indexes under 64, and every entry of a
//    transport this side has carrying the device and interface addresses its transport reads.
// A violation prints what was wrong and aborts, so libFuzzer keeps the input.
//
// Build: cmake -DPDLINK_BUILD_FUZZ=ON with clang (see .ci/fuzz.sh).
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>

#include "engine/engine_internal.h"
#include "transport/device/ipc_path.h"
#include "fuzz/fuzz_fixture.h"
#include "fuzz/memory_stream.h"
#include "fuzz/ucx_address_model.h"
#include "transport/ucx/ucx_worker.h"

namespace pdlink::fuzz {
namespace {

#define FUZZ_CHECK(cond)                                                                              \
  do {                                                                                                \
    if (!(cond)) {                                                                                    \
      std::fprintf(stderr, "wire_fuzz: invariant violated: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                                   \
    }                                                                                                 \
  } while (0)

bool prefixIs(const std::string& encoded, const uint8_t* p, size_t n) {
  return encoded.size() >= n && std::memcmp(encoded.data(), p, n) == 0;
}

void fuzzHello(const uint8_t* p, size_t n) {
  wire::Hello h;
  if (!wire::decodePrefix(p, n, &h).ok()) return;
  FUZZ_CHECK(n >= wire::kHelloPrefixBytes);
  FUZZ_CHECK(static_cast<uint8_t>(h.channel) <= static_cast<uint8_t>(wire::Channel::kLane));
  FUZZ_CHECK(prefixIs(wire::encode(h), p, wire::kHelloPrefixBytes));
  if (!wire::decodeRest(p + wire::kHelloPrefixBytes, n - wire::kHelloPrefixBytes, &h).ok()) {
    FUZZ_CHECK(n < wire::kHelloBytes);  // the rest is opaque bytes: only a short one is refused
    return;
  }
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kHelloBytes && prefixIs(e, p, wire::kHelloBytes));
}

void fuzzClientAuth(const uint8_t* p, size_t n) {
  wire::ClientAuth a;
  if (!wire::decode(p, n, &a).ok()) {
    FUZZ_CHECK(n < wire::kClientAuthBytes);
    return;
  }
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == wire::kClientAuthBytes && prefixIs(e, p, wire::kClientAuthBytes));
  (void)a.hint.sameHost(a.hint);
}

void fuzzHelloAck(const uint8_t* p, size_t n) {
  wire::HelloAck a;
  uint32_t len = 0;
  if (!wire::decodeFixed(p, n, &a, &len).ok()) return;
  FUZZ_CHECK(n >= wire::kHelloAckFixedBytes && len <= wire::kMaxMessageBytes && isKnownCode(a.status));
  a.message.assign(len, '\0');
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == wire::kHelloAckFixedBytes + len && prefixIs(e, p, wire::kHelloAckFixedBytes));
}

void fuzzAuthResult(const uint8_t* p, size_t n) {
  wire::AuthResult a;
  uint32_t len = 0;
  uint16_t redirect = 0;
  if (!wire::decodeFixed(p, n, &a, &len, &redirect).ok()) return;
  FUZZ_CHECK(n >= wire::kAuthResultFixedBytes && len <= wire::kMaxMessageBytes && isKnownCode(a.status) &&
             redirect <= limits::kUnixNameBytes && (a.flags & ~wire::kAuthPayloadIntegrity) == 0);
  a.message.assign(len, '\0');
  a.redirect.assign(redirect, '\0');
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == wire::kAuthResultFixedBytes + len + redirect && prefixIs(e, p, wire::kAuthResultFixedBytes));
}

void fuzzRequest(const uint8_t* p, size_t n) {
  wire::RequestHeader h;
  if (!wire::decode(p, n, &h).ok()) return;
  const uint8_t op = static_cast<uint8_t>(h.op);
  FUZZ_CHECK(n >= wire::kRequestHeaderBytes);
  // 8 and 10 (v4's device-channel and ucx-connect frames) are unknown ops since kPathConnect.
  FUZZ_CHECK(op >= 1 && op <= wire::kMaxOp && op != 8 && op != 10 && !(h.flags & ~wire::kKnownFlags) &&
             (!(h.flags & wire::kFlagOneSided) || h.flags == (wire::kFlagDevice | wire::kFlagOneSided)) &&
             (!(h.flags & wire::kFlagUcx) || h.flags == wire::kFlagUcx) && h.body_len <= wire::kMaxBodyBytes);
  // The split mark (flags bit 32) decodes apart from the flags, alone, on a read or a release only.
  FUZZ_CHECK(h.split == ((p[5] & wire::kMarkSplit) != 0) &&
             (!h.split || (h.flags == 0 && (h.op == wire::Op::kRead || h.op == wire::Op::kRelease))));
  // v8: the u16 at bytes 6-7 decodes only as zero; every field round-trips, the u32 epoch tag (bytes
  // 8-11) too: any value decodes.
  FUZZ_CHECK(p[6] == 0 && p[7] == 0);
  FUZZ_CHECK(h.epoch_tag ==
             (uint32_t{p[8]} | (uint32_t{p[9]} << 8) | (uint32_t{p[10]} << 16) | (uint32_t{p[11]} << 24)));
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kRequestHeaderBytes && prefixIs(e, p, wire::kRequestHeaderBytes));
}

void fuzzResponse(const uint8_t* p, size_t n) {
  wire::ResponseHeader h;
  if (!wire::decode(p, n, &h).ok()) return;
  FUZZ_CHECK(n >= wire::kResponseHeaderBytes);
  FUZZ_CHECK(h.message_len <= wire::kMaxMessageBytes && isKnownCode(h.status));
  // v8: the u32 epoch tag (bytes 20-23) is any value.
  FUZZ_CHECK(h.epoch_tag ==
             (uint32_t{p[20]} | (uint32_t{p[21]} << 8) | (uint32_t{p[22]} << 16) | (uint32_t{p[23]} << 24)));
  std::string e = wire::encode(h);
  FUZZ_CHECK(e.size() == wire::kResponseHeaderBytes && prefixIs(e, p, wire::kResponseHeaderBytes));
}

void fuzzDescriptor(const uint8_t* p, size_t n) {
  wire::CacheDescriptor d;
  if (!wire::decode(p, n, &d).ok()) return;
  FUZZ_CHECK(!d.addrs.empty() && d.addrs.size() <= limits::kMaxRequestTensors && d.stride > 0 &&
             d.stride <= d.tensor_size && n <= wire::kMaxDescriptorBytes);
  std::string e = wire::encode(d);
  FUZZ_CHECK(e.size() == n && prefixIs(e, p, n));  // the decoder takes exactly its bytes
}

void fuzzRawTable(const uint8_t* p, size_t n) {
  wire::RawTable t;
  if (!wire::decode(p, n, &t).ok()) return;
  FUZZ_CHECK(t.ranges.size() <= limits::kMaxRequestTensors && n <= wire::kMaxRawTableBytes);
  for (size_t i = 0; i < t.ranges.size(); ++i) {
    uint64_t end = 0;
    FUZZ_CHECK(t.ranges[i].length > 0 && !__builtin_add_overflow(t.ranges[i].offset, t.ranges[i].length, &end));
    FUZZ_CHECK(i == 0 || t.ranges[i - 1].offset <= t.ranges[i].offset);
  }
  std::string e = wire::encode(t);
  FUZZ_CHECK(e.size() == n && prefixIs(e, p, n));  // the decoder takes exactly its bytes
}

void fuzzNotify(const uint8_t* p, size_t n) {
  wire::NotifyBody b;
  if (!wire::decode(p, n, &b).ok()) return;
  FUZZ_CHECK(b.name.size() <= limits::kMaxNotifyNameBytes && b.message.size() <= limits::kMaxNotifyMessageBytes);
  std::string e = wire::encode(b);
  FUZZ_CHECK(e.size() == n && prefixIs(e, p, n));  // the decoder takes exactly its bytes
}

uint16_t u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

void fuzzDirectAnswer(const uint8_t* p, size_t n) {
  if (n < 2) return;
  const uint64_t expected = u16(p);
  wire::DirectAnswer a;
  if (!wire::decode(p + 2, n - 2, expected, &a).ok()) return;
  FUZZ_CHECK(a.addrs.size() == expected && a.lengths.size() == expected && n - 2 == wire::directAnswerBytes(expected));
  std::string e = wire::encode(a);
  FUZZ_CHECK(e.size() == n - 2 && prefixIs(e, p + 2, n - 2));
}

void fuzzAddresses(const uint8_t* p, size_t n) {
  if (n < 2) return;
  const uint64_t expected = u16(p);
  std::vector<uint64_t> out;
  if (!wire::decodeAddresses(p + 2, n - 2, expected, &out).ok()) return;
  FUZZ_CHECK(out.size() == expected && n - 2 == 8 * expected);
}

// The requester's side of IPC: a request of `tensors` x `runs` (runs from the input), the server's
// answer (the rest of the input). An answer the requester accepts must lead only to copies inside
// the spans the server says it exported, at the bases the keys were "mapped" at.
void fuzzIpcAnswer(const uint8_t* p, size_t n) {
  if (n < 2) return;
  const size_t tensors = 1 + p[0] % 8, nruns = 1 + p[1] % 8;
  if (n < 2 + 4 * nruns) return;
  std::vector<wire::Run> runs;
  for (size_t j = 0; j < nruns; ++j) runs.push_back({u16(p + 2 + 4 * j), 1 + uint64_t{u16(p + 4 + 4 * j)}});
  const uint8_t* ans = p + 2 + 4 * nruns;
  const size_t ans_len = n - 2 - 4 * nruns;
  wire::IpcAnswer a;
  if (!wire::decode(ans, ans_len, tensors, &a).ok()) return;
  FUZZ_CHECK(a.keys.size() == tensors && a.spans.size() == tensors);
  for (const std::string& k : a.keys) FUZZ_CHECK(!k.empty() && k.size() <= limits::kIpcKeyBytes);
  if (!checkIpcAnswer(a, runs).ok()) return;
  std::vector<uint64_t> local(tensors), remote(tensors);
  for (size_t i = 0; i < tensors; ++i) {
    local[i] = (uint64_t{1} << 40) * (i + 1);
    remote[i] = (uint64_t{1} << 44) * (i + 1);
  }
  for (bool push : {false, true}) {
    std::vector<DeviceCopy> copies = ipcCopies(local, runs, remote, runs, push);
    FUZZ_CHECK(copies.size() == tensors * nruns);
    for (size_t c = 0; c < copies.size(); ++c) {
      const size_t i = c / nruns;
      const uint64_t at = push ? copies[c].dst : copies[c].src;
      if (at < remote[i] || at + copies[c].length > remote[i] + a.spans[i]) {
        std::fprintf(stderr, "wire_fuzz: IPC copy [%#llx, +%llu) outside the exported span [%#llx, +%llu)\n",
                     static_cast<unsigned long long>(at), static_cast<unsigned long long>(copies[c].length),
                     static_cast<unsigned long long>(remote[i]), static_cast<unsigned long long>(a.spans[i]));
        std::abort();
      }
    }
  }
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
  // Runs go as pairs or as rows, whichever is smaller (wire v10): the round trip keeps what the
  // body names, not its bytes.
  std::string e = wire::encode(b);
  wire::TransferBody again;
  FUZZ_CHECK(wire::decode(reinterpret_cast<const uint8_t*>(e.data()), e.size(), &again).ok());
  FUZZ_CHECK(again.target.kind == b.target.kind && again.target.model_id == b.target.model_id &&
             again.target.req_id == b.target.req_id && again.target.prefix_id == b.target.prefix_id &&
             again.target.cache_id == b.target.cache_id && again.target.batch_index == b.target.batch_index &&
             again.block_size == b.block_size && again.tensors == b.tensors && again.runs.size() == b.runs.size());
  for (size_t i = 0; i < b.runs.size(); ++i) {
    FUZZ_CHECK(again.runs[i].offset == b.runs[i].offset && again.runs[i].length == b.runs[i].length);
  }
  const uint8_t kind = static_cast<uint8_t>(b.target.kind);
  FUZZ_CHECK(kind >= 1 && kind <= 6);  // 6: a KV handoff's offer (the registry refuses it: the offer table resolves it)
  Fixture fx;
  exerciseBody(fx, b);
}

// The bytes of every cache that is not remote accessible, to check no request changed them.
std::vector<std::string> protectedBytes(const EngineFixture& fx) {
  std::vector<std::string> out;
  for (const Region& g : fx.regions) {
    if (!g.remote_accessible) out.emplace_back(reinterpret_cast<const char*>(g.addr), g.size);
  }
  return out;
}

// No 8-byte little-endian window of what the serving loop sent lies inside a cache's tensor,
// unless the input itself carried those bytes (a write of them read back), or it is an entry of the
// memory table (Registry::describeRaw: a tensor's start address followed by its size), which a raw
// describe answers on any link.
void checkNoAddresses(const EngineFixture& fx, const std::string& out, const std::string& in) {
  for (size_t i = 0; i + 8 <= out.size(); ++i) {
    uint64_t v, next = 0;
    std::memcpy(&v, out.data() + i, 8);
    if (i + 16 <= out.size()) std::memcpy(&next, out.data() + i + 8, 8);
    for (const Region& g : fx.regions) {
      const bool table_entry = v == g.addr && next == g.size;
      if (v >= g.addr && v < g.addr + g.size && !table_entry && in.find(out.substr(i, 8)) == std::string::npos) {
        std::fprintf(stderr,
                     "wire_fuzz: the serving loop sent address %#llx (cache %lld) on a link that is not "
                     "same-host, at output byte %zu\n",
                     static_cast<unsigned long long>(v), static_cast<long long>(g.cache_id), i);
        std::abort();
      }
    }
  }
}

// The length of one frame step at p (header, body, and an in-stream write's payload as far as the
// input goes); 0 when no header decodes there (the rest is then handed over as it is).
size_t frameLength(const uint8_t* p, size_t n) {
  wire::RequestHeader h;
  if (n < wire::kRequestHeaderBytes || !wire::decode(p, wire::kRequestHeaderBytes, &h).ok()) return 0;
  uint64_t len = wire::kRequestHeaderBytes + uint64_t{h.body_len};
  if (h.op == wire::Op::kWrite && h.flags == 0) len += h.payload_len;
  return static_cast<size_t>(std::min<uint64_t>(len, n));
}

// Frames and registry changes against one real Engine: consecutive frames are one stream for
// Engine::serveStream (the real loop: admission, resolve, answers); the serving state carries over.
void fuzzServe(const uint8_t* p, size_t n) {
  if (n < 1) return;
  const bool same_host = p[0] & 1;
  EngineFixture fx;
  auto link = std::make_shared<Link>(9, Socket(), Socket(), false);
  if (same_host) link->setPeerProcess(::getpid(), 0);  // a peer the kernel put in this process
  Engine::ServeState state;
  PinEpochs::Word pin_epoch{1};  // the serving loop takes one per link (RequestServer::serve)
  state.pin_epoch = &pin_epoch;
  const std::vector<std::string> before = protectedBytes(fx);
  const std::string input(reinterpret_cast<const char*>(p), n);
  std::string stream;  // the frames gathered since the last registry step
  auto run = [&]() {
    if (stream.empty() || state.unlinked) return;
    MemoryStream in(reinterpret_cast<const uint8_t*>(stream.data()), stream.size());
    (void)fx.engine.serveStream(link, in, &state);
    if (!same_host) checkNoAddresses(fx, in.output(), input);
    stream.clear();
    FUZZ_CHECK(protectedBytes(fx) == before);
    FUZZ_CHECK(fx.engine.stats().notifications <= EngineLimits{}.max_notifications_per_link);
  };
  auto id = [](uint8_t v) { return static_cast<int64_t>(v % 7); };  // 0 and 6 name no cache
  size_t i = 1;
  while (i < n) {
    const uint8_t step = p[i++] % kStepCount;
    if (step == kStepFrame) {
      size_t len = frameLength(p + i, n - i);
      if (len == 0) len = n - i;  // no header here: the rest goes as it is (the loop drops the link)
      stream.append(reinterpret_cast<const char*>(p + i), len);
      i += len;
      continue;
    }
    run();
    if (step == kStepDeallocate && n - i >= 2) {
      (void)fx.engine.deallocateCache(id(p[i]), p[i + 1] & 1);
      i += 2;
    } else if (step == kStepUnregister && n - i >= 1) {
      (void)fx.engine.unregisterCache(id(p[i]));
      i += 1;
    } else if (step == kStepRemoveKey && n - i >= 3) {
      RequestKey k;
      k.req_id = p[i] == 0xFF ? kInvalidId : p[i];
      k.prefix_id = p[i + 1] == 0xFF ? kInvalidId : p[i + 1];
      k.model_id = p[i + 2];
      fx.engine.removeCacheKey(k);
      i += 3;
    } else {
      return;
    }
  }
  run();
}

// The transports of "this side" for the address check: tcp (UCX's checksum of "tcp") with a device
// and an interface address, and one with neither (as sysv is).
const ucx::WorkerAddressLayout& fuzzOwnLayout() {
  static const ucx::WorkerAddressLayout own = [] {
    ucx::WorkerAddressLayout l;
    l.entries.push_back({0x19cf, 0, 6, 2});
    l.entries.push_back({0x8b47, 4, 0, 0});
    return l;
  }();
  return own;
}

void fuzzUcxAddress(const uint8_t* p, size_t n) {
  if (n == 0) return;
  const unsigned minor = ucx::kAddressMinorFirst + p[0] % (ucx::kAddressMinorLast - ucx::kAddressMinorFirst + 1);
  ++p, --n;
  // Exactly the address's bytes on the heap: a read past its end is AddressSanitizer's to report.
  std::unique_ptr<uint8_t[]> buf(new uint8_t[n ? n : 1]);
  std::memcpy(buf.get(), p, n);
  Result<ucx::WorkerAddressLayout> parsed = ucx::parseWorkerAddress(buf.get(), n, minor);
  const Status checked = ucx::checkWorkerAddress(buf.get(), n, minor, fuzzOwnLayout());
  if (!parsed.ok()) {
    FUZZ_CHECK(parsed.status().code() == Code::kParamInvalid && !checked.ok());
    return;
  }
  const ucx::WorkerAddressLayout& L = parsed.value();
  ModelResult m;
  FUZZ_CHECK(unpackLikeUcx(buf.get(), minor, &m));      // UCX neither aborts nor refuses it
  FUZZ_CHECK(!m.empty_list && m.end == buf.get() + n);  // UCX reads exactly its bytes
  FUZZ_CHECK(m.addr_version == L.version && m.entries.size() == L.entries.size() && !L.entries.empty() &&
             L.entries.size() <= 128);
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const ModelEntry& e = m.entries[i];
    const ucx::AddressEntry& a = L.entries[i];
    FUZZ_CHECK(e.tl_name_csum == a.tl_name_csum && e.md_index == a.md_index && e.dev_addr_len == a.dev_addr_len &&
               e.iface_addr_len == a.iface_addr_len);
    FUZZ_CHECK(e.num_ep_addrs == 0 && e.md_index < 64);
    if (!checked.ok()) continue;
    for (const ucx::AddressEntry& mine : fuzzOwnLayout().entries) {
      if (mine.tl_name_csum != e.tl_name_csum) continue;
      FUZZ_CHECK(!(mine.dev_addr_len > 0 && e.dev_addr_null) && !(mine.iface_addr_len > 0 && e.iface_addr_null));
    }
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
    case kModeHello:
      fuzzHello(p, n);
      break;
    case kModeClientAuth:
      fuzzClientAuth(p, n);
      break;
    case kModeHelloAck:
      fuzzHelloAck(p, n);
      break;
    case kModeAuthResult:
      fuzzAuthResult(p, n);
      break;
    case kModeRequest:
      fuzzRequest(p, n);
      break;
    case kModeResponse:
      fuzzResponse(p, n);
      break;
    case kModeBody:
      fuzzBody(p, n);
      break;
    case kModeDescriptor:
      fuzzDescriptor(p, n);
      break;
    case kModeServe:
      fuzzServe(p, n);
      break;
    case kModeDirectAnswer:
      fuzzDirectAnswer(p, n);
      break;
    case kModeAddresses:
      fuzzAddresses(p, n);
      break;
    case kModeIpcAnswer:
      fuzzIpcAnswer(p, n);
      break;
    case kModeNotify:
      fuzzNotify(p, n);
      break;
    case kModeRawTable:
      fuzzRawTable(p, n);
      break;
    case kModeUcxAddress:
      fuzzUcxAddress(p, n);
      break;
  }
  return 0;
}
