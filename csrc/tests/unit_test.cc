// Unit tests of the pieces under the data paths, each on its own, in one process:
//   - the wire decoders (transport/wire.h): every frame round-trips; a short, long, bad-magic,
//     unknown-op or unknown-flag frame, a count past its limit or past the bytes that are there,
//     and an answer of the wrong size are refused with kLinkFailed, before anything is allocated
//     for them;
//     (notification bodies too: NUL bytes kept, each field at and one past its limit; the ucx flag
//     only alone, and a ucx hello's token and address, at and one past the address limit);
//   - the registry (engine/registry.h): ids, key binding that changes nothing when refused,
//     resolve of every target kind against its bounds with the exact code, the write check, raw
//     addresses inside one tensor or across up to 64 that follow each other, one reference per
//     distinct cache however many ranges name it, a request's steps bounded by
//     max_request_span_steps (exactly the bound passes, one more is refused), an add() let in
//     promptly while two threads resolve the largest such requests back to back, describe and its
//     generation, unregister, and the reference counting that returns a pool-allocated cache's
//     memory once its id and keys are gone;
//   - the memory pool (engine/mem_pool.h): page-aligned, disjoint allocations, kOutOfMemory at the
//     end and for sizes past the pool (none wraps around), release that merges neighbours;
//   - Status's scope (core/status.h): each code's default, an explicit scope kept, OK's kCall.
//
// Usage: unit_test. Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "backends/backend.h"
#include "core/limits.h"
#include "engine/mem_pool.h"
#include "engine/engine_types.h"
#include "engine/registry.h"
#include "engine/telemetry.h"
#include "test_engines.h"
#include "transport/wire.h"

using namespace pdlink;
using testing::check;
using testing::checkCode;

namespace {

const uint8_t* bytes(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

// ---------------------------------------------------------------- wire decoders

void requestHeaderCases() {
  wire::RequestHeader h{wire::Op::kWrite, 123, 456789, wire::kFlagDirect};
  std::string f = wire::encode(h);
  check(f.size() == wire::kRequestHeaderBytes, "request header: encoded size");
  wire::RequestHeader got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: round trip");
  check(got.op == h.op && got.body_len == h.body_len && got.payload_len == h.payload_len && got.flags == h.flags,
        "request header: fields round-trip");
  checkCode(wire::decode(bytes(f), f.size() - 1, &got), Code::kLinkFailed, "request header: one byte short");
  std::string bad = f;
  bad[0] ^= 1;
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed, "request header: bad magic");
  // 8 and 10: v4's device-channel and ucx-connect frames, unknown since kPathConnect replaced them.
  for (uint8_t op : {uint8_t{0}, uint8_t{8}, uint8_t{10}, static_cast<uint8_t>(wire::kMaxOp + 1), uint8_t{255}}) {
    bad = f;
    bad[4] = static_cast<char>(op);
    checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed,
              "request header: op " + std::to_string(op));
  }
  for (uint8_t op = 0; op <= wire::kMaxOp + 1; ++op) {
    bad = f;
    bad[4] = static_cast<char>(op);
    bad[5] = 0;
    const bool known = op == 1 || op == 2 || op == 3 || op == 4 || op == 5 || op == 6 || op == 7 || op == 9 ||
                       op == 11 || op == static_cast<uint8_t>(wire::Op::kPathConnect) ||
                       op == static_cast<uint8_t>(wire::Op::kHandoff);
    check(wire::isOp(op) == known, "request header: op " + std::to_string(op) + " known or not");
    checkCode(wire::decode(bytes(bad), bad.size(), &got), known ? Code::kSuccess : Code::kLinkFailed,
              "request header: decoding op " + std::to_string(op));
  }
  // A kPathConnect body: the path's id, then its setup body.
  check(wire::pathConnectBody(wire::kFlagUcx, "hello") == std::string("\x08hello", 6) &&
            wire::pathConnectBody(wire::kFlagDevice, "") == std::string(1, '\x02'),
        "path connect body: the header byte, then the setup body");
  bad = f;
  bad[5] = static_cast<char>(0x80);
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed, "request header: an unknown flag");
  // one-sided only together with device, and nothing else
  for (uint8_t flags :
       {wire::kFlagOneSided, static_cast<uint8_t>(wire::kFlagOneSided | wire::kFlagDirect), wire::kKnownFlags}) {
    f = wire::encode(wire::RequestHeader{wire::Op::kRead, 0, 0, flags});
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed,
              "request header: flags " + std::to_string(flags));
  }
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, 0, 0, wire::kFlagDevice | wire::kFlagOneSided});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: device | one-sided");
  // the split mark: alone, on a read or a release; decoded apart from the flags, encoded back
  for (wire::Op op : {wire::Op::kRead, wire::Op::kRelease}) {
    f = wire::encode(wire::RequestHeader{op, 0, 0, 0, 0, true});
    check(static_cast<uint8_t>(f[5]) == wire::kMarkSplit, "request header: the split mark's bit");
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: split mark");
    check(got.split && got.flags == 0 && got.op == op, "request header: split mark decoded");
  }
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, 0, 0, 0});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: no split mark");
  check(!got.split, "request header: no split mark decoded");
  for (wire::RequestHeader h :
       {wire::RequestHeader{wire::Op::kWrite, 0, 0, 0, 0, true}, wire::RequestHeader{wire::Op::kPing, 0, 0, 0, 0, true},
        wire::RequestHeader{wire::Op::kRead, 0, 0, wire::kFlagDirect, 0, true}}) {
    f = wire::encode(h);
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "request header: a misplaced split mark");
  }
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, wire::kMaxBodyBytes + 1, 0, 0});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "request header: body past the limit");
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, wire::kMaxBodyBytes, 0, 0});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: body at the limit");
  // v8: 24 bytes; the u16 at offset 6 is reserved (zero), the u32 at offset 8 the epoch tag; every tag
  // value decodes and round-trips, little-endian, those past v7's 16 bits too.
  for (uint32_t tag : {uint32_t{0}, uint32_t{1}, uint32_t{0xFFFF}, uint32_t{0x10000}, wire::epochTagOf(65535),
                       uint32_t{0x12345678}, wire::epochTagOf(uint64_t{0xFFFFFFFE}), uint32_t{0xFFFFFFFF}}) {
    f = wire::encode(wire::RequestHeader{wire::Op::kRead, 10, 0, 0, tag});
    uint32_t at8 = 0;
    for (int i = 0; i < 4; ++i) at8 |= uint32_t{static_cast<uint8_t>(f[8 + i])} << (8 * i);
    check(f.size() == wire::kRequestHeaderBytes && wire::kRequestHeaderBytes == 24 && f[6] == 0 && f[7] == 0 &&
              at8 == tag,
          "request header: 24 bytes, a zero u16 at offset 6, the epoch tag at offset 8 (" + std::to_string(tag) + ")");
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: any epoch tag decodes");
    check(got.epoch_tag == tag && got.body_len == 10, "request header: the epoch tag round-trips");
  }
  // The reserved u16 decodes only as zero: any other value is malformed.
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, 10, 0, 0, 7});
  checkCode(wire::decode(bytes(f), f.size() - 1, &got), Code::kLinkFailed, "request header: one byte short");
  for (size_t at : {size_t{6}, size_t{7}}) {
    for (uint8_t v : {uint8_t{1}, uint8_t{0x80}, uint8_t{0xFF}}) {
      std::string bad = f;
      bad[at] = static_cast<char>(v);
      checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed,
                "request header: a non-zero reserved byte " + std::to_string(at) + " is malformed");
    }
  }
  check(wire::epochTagOf(0) == 1 && wire::epochTagOf(65534) == 65535 && wire::epochTagOf(65535) == 65536 &&
            wire::epochTagOf(uint64_t{0xFFFFFFFE}) == 0xFFFFFFFF && wire::epochTagOf(uint64_t{0xFFFFFFFF}) == 1 &&
            wire::epochTagOf(UINT64_MAX) != 0,
        "epoch tag: 1 + epoch % 0xFFFFFFFF, never 0; v7's wrap at 65535 is gone");
}

void responseHeaderCases() {
  wire::ResponseHeader h{static_cast<uint32_t>(Code::kKvCacheNotExist), 17, 0};
  std::string f = wire::encode(h);
  wire::ResponseHeader got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "response header: round trip");
  check(got.status == h.status && got.message_len == 17, "response header: fields round-trip");
  f = wire::encode(wire::ResponseHeader{999999, 0, 0});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "response header: an unknown status code");
  f = wire::encode(wire::ResponseHeader{1, wire::kMaxMessageBytes + 1, 0});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "response header: text past the limit");
  // v8: 24 bytes, the server's u32 epoch tag at offset 20 (v7: a u16 tag and a zero u16); any value decodes.
  for (uint32_t tag : {uint32_t{0xBEEF}, uint32_t{0x10000}, uint32_t{0xDEADBEEF}, uint32_t{0xFFFFFFFF}}) {
    f = wire::encode(wire::ResponseHeader{static_cast<uint32_t>(Code::kStaleEpoch), 0, 0, tag});
    uint32_t at20 = 0;
    for (int i = 0; i < 4; ++i) at20 |= uint32_t{static_cast<uint8_t>(f[20 + i])} << (8 * i);
    check(f.size() == wire::kResponseHeaderBytes && wire::kResponseHeaderBytes == 24 && at20 == tag,
          "response header: 24 bytes, the epoch tag at offset 20 (" + std::to_string(tag) + ")");
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "response header: the stale-epoch code decodes");
    check(got.epoch_tag == tag && got.status == static_cast<uint32_t>(Code::kStaleEpoch),
          "response header: the epoch tag round-trips");
    checkCode(wire::decode(bytes(f), f.size() - 1, &got), Code::kLinkFailed, "response header: one byte short");
  }
  f = wire::encode(wire::ResponseHeader{static_cast<uint32_t>(Code::kRoleSwitching), 0, 0, 1});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "response header: the role-switching code decodes");
}

void notifyBodyCases() {
  wire::NotifyBody b{"req-7", std::string("done\0with a NUL", 15)};
  std::string f = wire::encode(b);
  wire::NotifyBody got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "notify body: round trip");
  check(got.name == b.name && got.message == b.message, "notify body: fields round-trip (bytes, NUL included)");
  for (size_t n = 0; n < 4 + b.name.size(); ++n) {  // a short count, or a name cut short
    if (wire::decode(bytes(f), n, &got).code() != Code::kLinkFailed) {
      check(false, "notify body: truncated to " + std::to_string(n) + " bytes is refused");
      break;
    }
  }
  checkCode(wire::decode(bytes(f), 4 + b.name.size(), &got), Code::kSuccess, "notify body: an empty message");
  check(got.name == b.name && got.message.empty(), "notify body: the empty message");
  const std::string name_max(limits::kMaxNotifyNameBytes, 'n'), message_max(limits::kMaxNotifyMessageBytes, 'm');
  f = wire::encode(wire::NotifyBody{name_max, message_max});
  check(f.size() == wire::kMaxNotifyBodyBytes, "notify body: the largest is kMaxNotifyBodyBytes");
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "notify body: both fields at their limit");
  f = wire::encode(wire::NotifyBody{name_max + "n", ""});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "notify body: a name one past its limit");
  f = wire::encode(wire::NotifyBody{"", message_max + "m"});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "notify body: a message one past its limit");
  f = wire::encode(wire::NotifyBody{"abc", ""});
  f[0] = 4;  // a name longer than the bytes that follow
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "notify body: a count past the bytes");
}

void ucxCases() {
  // kFlagUcx only alone
  wire::RequestHeader h{wire::Op::kRead, 10, 0, wire::kFlagUcx};
  std::string f = wire::encode(h);
  wire::RequestHeader got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: ucx alone");
  for (uint8_t other : {wire::kFlagDirect, wire::kFlagDevice, wire::kFlagOneSided}) {
    f = wire::encode(wire::RequestHeader{wire::Op::kRead, 10, 0, static_cast<uint8_t>(wire::kFlagUcx | other)});
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed,
              "request header: ucx with flag " + std::to_string(other));
  }
  // kFlagTestPath likewise (the engine then drops it unless a test build registered its path)
  f = wire::encode(wire::RequestHeader{wire::Op::kRead, 10, 0, wire::kFlagTestPath});
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "request header: the test path's flag alone");
  for (uint8_t other : {wire::kFlagDirect, wire::kFlagDevice, wire::kFlagUcx}) {
    f = wire::encode(wire::RequestHeader{wire::Op::kRead, 10, 0, static_cast<uint8_t>(wire::kFlagTestPath | other)});
    checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed,
              "request header: the test path's flag with flag " + std::to_string(other));
  }
  // a UcxHello: a token, a message size (0, or a power of two in [16 KiB, 1 MiB]) and 1 ..
  // kMaxUcxAddressBytes bytes of address
  wire::UcxHello hello{0x1122334455667788ull, 65536, std::string("\0addr\xff", 6)};
  f = wire::encode(hello);
  wire::UcxHello out;
  checkCode(wire::decode(bytes(f), f.size(), &out), Code::kSuccess, "ucx hello: round trip");
  check(out.token == hello.token && out.chunk_bytes == 65536 && out.address == hello.address,
        "ucx hello: fields round-trip (bytes, NUL included)");
  for (size_t n = 0; n <= 12; ++n) {  // no token, no size, or no address
    if (wire::decode(bytes(f), n, &out).code() != Code::kLinkFailed) {
      check(false, "ucx hello: " + std::to_string(n) + " bytes are refused");
      break;
    }
  }
  for (uint32_t size : {0u, wire::kMinUcxChunkBytes, wire::kMaxUcxChunkBytes}) {
    f = wire::encode(wire::UcxHello{1, size, "a"});
    checkCode(wire::decode(bytes(f), f.size(), &out), Code::kSuccess, "ucx hello: size " + std::to_string(size));
  }
  for (uint32_t size :
       {1u, wire::kMinUcxChunkBytes / 2, wire::kMinUcxChunkBytes + 1, wire::kMaxUcxChunkBytes * 2, 0xffffffffu}) {
    f = wire::encode(wire::UcxHello{1, size, "a"});
    checkCode(wire::decode(bytes(f), f.size(), &out), Code::kLinkFailed, "ucx hello: size " + std::to_string(size));
  }
  f = wire::encode(wire::UcxHello{1, 0, std::string(wire::kMaxUcxAddressBytes, 'a')});
  checkCode(wire::decode(bytes(f), f.size(), &out), Code::kSuccess, "ucx hello: the longest address");
  f = wire::encode(wire::UcxHello{1, 0, std::string(wire::kMaxUcxAddressBytes + 1, 'a')});
  checkCode(wire::decode(bytes(f), f.size(), &out), Code::kLinkFailed, "ucx hello: an address one past the limit");
}

wire::TransferBody body(wire::TargetKind kind, std::vector<uint32_t> tensors, std::vector<wire::Run> runs) {
  wire::TransferBody b;
  b.target.kind = kind;
  b.target.model_id = 7;
  b.target.req_id = 11;
  b.target.prefix_id = 13;
  b.target.cache_id = 17;
  b.target.batch_index = 19;
  b.block_size = 256;
  b.tensors = std::move(tensors);
  b.runs = std::move(runs);
  return b;
}

void transferBodyCases() {
  wire::TransferBody b = body(wire::TargetKind::kPrefixKey, {0, 3}, {{0, 256}, {1024, 512}});
  std::string f = wire::encode(b);
  wire::TransferBody got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "transfer body: round trip");
  check(got.target.kind == b.target.kind && got.target.model_id == 7 && got.target.req_id == 11 &&
            got.target.prefix_id == 13 && got.target.cache_id == 17 && got.target.batch_index == 19 &&
            got.block_size == 256 && got.tensors == b.tensors && got.runs.size() == 2 && got.runs[1].offset == 1024 &&
            got.runs[1].length == 512,
        "transfer body: fields round-trip");
  auto payload = got.payloadBytes();
  check(payload.ok() && payload.value() == 2 * (256 + 512), "transfer body: payload bytes");
  // every truncation, and one byte too many
  for (size_t n = 0; n < f.size(); ++n) {
    wire::TransferBody t;
    if (wire::decode(bytes(f), n, &t).code() != Code::kLinkFailed) {
      check(false, "transfer body: truncated to " + std::to_string(n) + " bytes is refused");
      break;
    }
  }
  std::string longer = f + '\0';
  checkCode(wire::decode(bytes(longer), longer.size(), &got), Code::kLinkFailed, "transfer body: a trailing byte");
  std::string bad = f;
  bad[0] = 7;  // 6 is kOffer (a KV handoff's offer, since the handoffs)
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed, "transfer body: target kind 7");
  bad[0] = 6;
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kSuccess, "transfer body: target kind 6 (offer)");
  bad[0] = 0;
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed, "transfer body: target kind 0");
  // kHandoff bodies: both kinds round trip; every bound and every mismatch is refused.
  {
    wire::HandoffBody abort{wire::HandoffBody::kAbort, "req-1", "gone", {}};
    wire::HandoffBody hold{wire::HandoffBody::kHold, "", "", {{1, 2}, {3, 4}}};
    wire::HandoffBody a2, h2;
    std::string ea = wire::encode(abort), eh = wire::encode(hold);
    checkCode(wire::decode(bytes(ea), ea.size(), &a2), Code::kSuccess, "handoff: abort");
    check(a2.kind == wire::HandoffBody::kAbort && a2.request_id == "req-1" && a2.reason == "gone", "handoff: abort");
    checkCode(wire::decode(bytes(eh), eh.size(), &h2), Code::kSuccess, "handoff: hold");
    check(h2.kind == wire::HandoffBody::kHold && h2.offers == hold.offers, "handoff: hold round trip");
    for (size_t cut = 0; cut < ea.size(); ++cut) {
      checkCode(wire::decode(bytes(ea), cut, &a2), Code::kLinkFailed, "handoff: abort cut at " + std::to_string(cut));
    }
    for (size_t cut = 0; cut < eh.size(); ++cut) {
      checkCode(wire::decode(bytes(eh), cut, &h2), Code::kLinkFailed, "handoff: hold cut at " + std::to_string(cut));
    }
    std::string trailing = ea + 'x';
    checkCode(wire::decode(bytes(trailing), trailing.size(), &a2), Code::kLinkFailed, "handoff: trailing byte");
    wire::HandoffBody too_long{
        wire::HandoffBody::kAbort, std::string(limits::kMaxHandoffRequestIdBytes + 1, 'r'), "", {}};
    std::string el = wire::encode(too_long);
    checkCode(wire::decode(bytes(el), el.size(), &a2), Code::kLinkFailed, "handoff: request id past its bound");
    std::string huge = eh;
    huge[1] = huge[2] = huge[3] = huge[4] = '\xff';  // a count of 2^32 - 1 with two entries
    checkCode(wire::decode(bytes(huge), huge.size(), &h2), Code::kLinkFailed, "handoff: hold count 2^32 - 1");
    // A request id or reason that is not UTF-8 is malformed (the link drops); a NUL is a character.
    const std::string nul("r\0q", 3);
    for (const auto& [rid, why, ok] : std::vector<std::tuple<std::string, std::string, bool>>{
             {nul, std::string("a\0b", 3), true},
             {"\xc3\xa9t\xc3\xa9", "\xe2\x82\xac \xf0\x9f\x98\x80", true},  // two- to four-byte forms
             {"\xef\xbf\xbf", "\xf4\x8f\xbf\xbf", true},                    // U+FFFF, U+10FFFF
             {"\xff\xfe", "x", false},                                      // bytes never in UTF-8
             {"ok", "\xc3", false},                                         // a cut sequence
             {"\x80", "", false},                                           // a lone continuation
             {"\xc0\xaf", "", false},                                       // overlong '/'
             {"\xe0\x80\xaf", "", false},                                   // overlong, three bytes
             {"\xed\xa0\x80", "", false},                                   // a surrogate (U+D800)
             {"\xf4\x90\x80\x80", "", false},                               // past U+10FFFF
             {"ok", "\xe2\x82", false},                                     // a cut three-byte form
         }) {
      const std::string e = wire::encode(wire::HandoffBody{wire::HandoffBody::kAbort, rid, why, {}});
      const std::string what = "handoff: abort with a " + std::string(ok ? "valid" : "malformed") + " UTF-8 field";
      checkCode(wire::decode(bytes(e), e.size(), &a2), ok ? Code::kSuccess : Code::kLinkFailed, what);
      if (ok) check(a2.request_id == rid && a2.reason == why, what + ": round trip");
    }
  }
  // counts past the limits are refused (the encoder writes what it is given)
  std::vector<uint32_t> many(limits::kMaxRequestTensors + 1, 0);
  f = wire::encode(body(wire::TargetKind::kBlocks, many, {{0, 1}}));
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "transfer body: tensors past the limit");
  std::vector<wire::Run> runs(limits::kMaxRequestPieces / 2 + 1, wire::Run{0, 1});
  f = wire::encode(body(wire::TargetKind::kBlocks, {0, 1}, runs));
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed, "transfer body: pieces past the limit");
  runs.resize(limits::kMaxRequestPieces / 2);
  f = wire::encode(body(wire::TargetKind::kBlocks, {0, 1}, runs));
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "transfer body: pieces at the limit");
  // a count that claims more than the bytes that follow: refused before it is allocated
  f = wire::encode(body(wire::TargetKind::kBlocks, {0}, {{0, 1}}));
  bad = f;
  const size_t tensor_count_at = 1 + 8 * 6;  // kind, then six u64 fields
  bad[tensor_count_at] = bad[tensor_count_at + 1] = bad[tensor_count_at + 2] = static_cast<char>(0xFF);
  bad[tensor_count_at + 3] = 0x7F;
  checkCode(wire::decode(bytes(bad), bad.size(), &got), Code::kLinkFailed, "transfer body: a huge tensor count");
  // a payload that would overflow 64 bits
  wire::TransferBody huge = body(wire::TargetKind::kRaw, {0, 1}, {{0, std::numeric_limits<uint64_t>::max() / 2 + 1}});
  checkCode(huge.payloadBytes().status(), Code::kParamInvalid, "transfer body: payload overflowing 64 bits");
}

// Rows (wire v10): runs in arithmetic progression are sent as rows, decoded into the same runs;
// every row the decoder cannot expand safely is malformed.
void rowCases() {
  using Rows = std::vector<wire::Row>;
  auto same = [](const Rows& a, const Rows& b) {
    return a.size() == b.size() &&
           std::equal(a.begin(), a.end(), b.begin(), [](const wire::Row& x, const wire::Row& y) {
             return x.offset == y.offset && x.length == y.length && x.stride == y.stride && x.count == y.count;
           });
  };
  const std::vector<wire::Run> runs = {{0, 16}, {32, 16}, {64, 16}, {100, 8}, {100, 8}, {200, 4}, {150, 4}, {100, 4}};
  check(same(wire::rowsOf(runs), Rows{{0, 16, 32, 3}, {100, 8, 0, 2}, {200, 4, 4, 1}, {150, 4, 4, 1}, {100, 4, 4, 1}}),
        "rows: a stride, the same bytes again, and runs going back each their own row");
  check(wire::rowsOf({}).empty(), "rows: none of no runs");
  wire::TransferBody b = body(wire::TargetKind::kBlocks, {0, 1}, {{0, 16}, {32, 16}, {64, 16}});
  std::string f = wire::encode(b);
  const size_t count_at = 1 + 8 * 6 + 4 + 4 * 2;
  uint32_t stated = 0;
  std::memcpy(&stated, f.data() + count_at, sizeof(stated));
  check(stated == (1 | wire::kRowsMark) && f.size() == count_at + 4 + 32, "rows: three runs of one stride go as a row");
  wire::TransferBody got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "rows: decoded");
  check(got.runs.size() == 3 && got.runs[2].offset == 64 && got.runs[2].length == 16 &&
            same(got.rows, Rows{{0, 16, 32, 3}}) && got.rows[0].end() == 80,
        "rows: the runs, and the row kept");
  f = wire::encode(body(wire::TargetKind::kBlocks, {0}, {{0, 16}, {32, 16}}));
  std::memcpy(&stated, f.data() + 1 + 8 * 6 + 4 + 4, sizeof(stated));
  check(stated == 2, "rows: two runs go as pairs (a row is not smaller)");
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "rows: pairs decoded");
  check(got.rows.empty(), "rows: none kept for pairs");
  auto encoded = [](const Rows& rows, uint32_t tensors, uint32_t count) {
    std::string out = wire::encode(body(wire::TargetKind::kBlocks, {}, {}));
    out.resize(1 + 8 * 6);  // the target and block size
    auto put = [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); };
    put(&tensors, 4);
    for (uint32_t t = 0; t < tensors; ++t) put(&t, 4);
    put(&count, 4);
    for (const wire::Row& r : rows) {
      put(&r.offset, 8);
      put(&r.length, 8);
      put(&r.stride, 8);
      put(&r.count, 8);
    }
    return out;
  };
  const uint64_t kMax = limits::kMaxRequestPieces;
  struct Bad {
    Rows rows;
    uint32_t tensors;
    uint32_t count;
    const char* what;
  };
  const uint64_t top = std::numeric_limits<uint64_t>::max();
  for (const Bad& c : std::vector<Bad>{
           {{{0, 16, 16, 0}}, 1, 1 | wire::kRowsMark, "a row of no run"},
           {{{top - 63, 16, 32, 3}}, 1, 1 | wire::kRowsMark, "a row that wraps"},
           {{{0, 16, uint64_t{1} << 63, 3}}, 1, 1 | wire::kRowsMark, "a stride past 64 bits"},
           {{{1, top, 0, 1}}, 1, 1 | wire::kRowsMark, "a length that wraps"},
           {{}, 1, wire::kRowsMark, "no rows"},
           {{{0, 16, 16, 2}}, 1, 2 | wire::kRowsMark, "more rows stated than sent"},
           {{{0, 1, 1, kMax + 1}}, 1, 1 | wire::kRowsMark, "a row past the piece limit"},
           {{{0, 1, 1, kMax / 2}, {0, 1, 1, kMax / 2 + 1}}, 1, 2 | wire::kRowsMark, "rows past the piece limit"},
           {{{0, 1, 1, kMax / 2 + 1}}, 2, 1 | wire::kRowsMark, "a row past the limit with its tensors"},
           {{{0, 1, 1, 1}}, 0, 1 | wire::kRowsMark, "fine: one run of no tensor"},
       }) {
    std::string e = encoded(c.rows, c.tensors, c.count);
    const bool fine = std::string(c.what).rfind("fine", 0) == 0;
    checkCode(wire::decode(bytes(e), e.size(), &got), fine ? Code::kSuccess : Code::kLinkFailed,
              std::string("rows: ") + c.what);
  }
  std::string at = encoded({{0, 1, 0, kMax / 2}}, 2, 1 | wire::kRowsMark);
  checkCode(wire::decode(bytes(at), at.size(), &got), Code::kSuccess, "rows: at the piece limit with its tensors");
  check(got.runs.size() == kMax / 2, "rows: every run of a row at the limit");
  std::string e = encoded({{0, 16, 16, 2}}, 1, 1 | wire::kRowsMark);
  for (size_t n = 0; n < e.size(); ++n) {
    if (wire::decode(bytes(e), n, &got).code() != Code::kLinkFailed) {
      check(false, "rows: truncated to " + std::to_string(n) + " bytes is refused");
      break;
    }
  }
}

void descriptorAndAnswerCases() {
  wire::CacheDescriptor d{5, 4096, 256, {0x1000, 0x9000}};
  std::string f = wire::encode(d);
  wire::CacheDescriptor got;
  checkCode(wire::decode(bytes(f), f.size(), &got), Code::kSuccess, "descriptor: round trip");
  check(got.generation == 5 && got.tensor_size == 4096 && got.stride == 256 && got.addrs == d.addrs,
        "descriptor: fields round-trip");
  checkCode(wire::decode(bytes(f), f.size() - 1, &got), Code::kLinkFailed, "descriptor: one byte short");
  for (const wire::CacheDescriptor& bad :
       {wire::CacheDescriptor{5, 4096, 0, {1}}, wire::CacheDescriptor{5, 4096, 8192, {1}},
        wire::CacheDescriptor{5, 4096, 256, {}},
        wire::CacheDescriptor{5, 4096, 256, std::vector<uint64_t>(limits::kMaxRequestTensors + 1, 1)}}) {
    f = wire::encode(bad);
    checkCode(
        wire::decode(bytes(f), f.size(), &got), Code::kLinkFailed,
        "descriptor: stride " + std::to_string(bad.stride) + ", " + std::to_string(bad.addrs.size()) + " addresses");
  }
  check(f.size() > wire::kMaxDescriptorBytes, "descriptor: one past the tensor limit is longer than the most read");

  wire::RawTable t{7, {{0x1000, 4096}, {0x1000, 64}, {0x9000, 8192}}};
  f = wire::encode(t);
  wire::RawTable gt;
  checkCode(wire::decode(bytes(f), f.size(), &gt), Code::kSuccess, "raw table: round trip");
  check(gt.generation == 7 && gt.ranges.size() == 3 && gt.ranges[2].offset == 0x9000 && gt.ranges[2].length == 8192,
        "raw table: fields round-trip");
  checkCode(wire::decode(bytes(f), f.size() - 1, &gt), Code::kLinkFailed, "raw table: one byte short");
  checkCode(wire::decode(bytes(f), 11, &gt), Code::kLinkFailed, "raw table: truncated count");
  std::string trailing = f + "x";
  checkCode(wire::decode(bytes(trailing), trailing.size(), &gt), Code::kLinkFailed, "raw table: a trailing byte");
  for (const wire::RawTable& bad :
       {wire::RawTable{7, {{0x1000, 0}}}, wire::RawTable{7, {{UINT64_MAX - 8, 16}}},
        wire::RawTable{7, {{0x9000, 16}, {0x1000, 16}}},
        wire::RawTable{7, std::vector<wire::Run>(limits::kMaxRequestTensors + 1, wire::Run{0x1000, 1})}}) {
    f = wire::encode(bad);
    checkCode(wire::decode(bytes(f), f.size(), &gt), Code::kLinkFailed,
              "raw table: " + std::to_string(bad.ranges.size()) + " ranges, empty, wrapping or unsorted");
  }
  check(f.size() > wire::kMaxRawTableBytes, "raw table: one past the range limit is longer than the most read");
  wire::RawTable at_limit{7, std::vector<wire::Run>(limits::kMaxRequestTensors, wire::Run{0x1000, 1})};
  f = wire::encode(at_limit);
  checkCode(wire::decode(bytes(f), f.size(), &gt), Code::kSuccess, "raw table: at the range limit");
  check(f.size() == wire::kMaxRawTableBytes, "raw table: at the limit it is the most read");

  wire::DirectAnswer a{9, 0x7f00, {0x10, 0x20, 0x30}, {1, 2, 3}};
  f = wire::encode(a);
  check(f.size() == wire::directAnswerBytes(3), "direct answer: encoded size");
  wire::DirectAnswer da;
  checkCode(wire::decode(bytes(f), f.size(), 3, &da), Code::kSuccess, "direct answer: round trip");
  check(da.pin_epoch == 9 && da.epoch_addr == 0x7f00 && da.addrs == a.addrs && da.lengths == a.lengths,
        "direct answer: fields round-trip");
  checkCode(wire::decode(bytes(f), f.size(), 2, &da), Code::kLinkFailed, "direct answer: more pieces than asked");
  checkCode(wire::decode(bytes(f), f.size(), 4, &da), Code::kLinkFailed, "direct answer: fewer pieces than asked");
  checkCode(wire::decode(bytes(f), f.size(), limits::kMaxRequestPieces + 1, &da), Code::kLinkFailed,
            "direct answer: an expectation past the limit");

  std::vector<uint64_t> addrs;
  std::string list(24, '\x01');
  checkCode(wire::decodeAddresses(bytes(list), list.size(), 3, &addrs), Code::kSuccess, "address list: 3 of 3");
  check(addrs.size() == 3 && addrs[0] == 0x0101010101010101ULL, "address list: values");
  checkCode(wire::decodeAddresses(bytes(list), list.size() - 1, 3, &addrs), Code::kLinkFailed,
            "address list: one byte short");

  wire::IpcAnswer ipc{{"key-a", std::string(limits::kIpcKeyBytes, 'k')}, {4096, 8192}};
  f = wire::encode(ipc);
  check(f.size() == 2 * wire::kIpcEntryBytes, "IPC answer: encoded size");
  wire::IpcAnswer gi;
  checkCode(wire::decode(bytes(f), f.size(), 2, &gi), Code::kSuccess, "IPC answer: round trip");
  check(gi.keys == ipc.keys && gi.spans == ipc.spans, "IPC answer: a short key and a full-length key round-trip");
  checkCode(wire::decode(bytes(f), f.size(), 1, &gi), Code::kLinkFailed, "IPC answer: more tensors than asked");
  std::string empty_key = f;
  for (size_t i = 0; i < limits::kIpcKeyBytes; ++i) empty_key[wire::kIpcEntryBytes + i] = '\0';
  checkCode(wire::decode(bytes(empty_key), empty_key.size(), 2, &gi), Code::kLinkFailed, "IPC answer: an empty key");
}

// ---------------------------------------------------------------- registry

constexpr uint64_t kSlots = 4, kStride = 256;

CacheEntry userCache(std::vector<uint8_t>* mem, uint32_t tensors, bool blocks, std::optional<uint64_t> model,
                     bool remote = true) {
  mem->assign(uint64_t{tensors} * kSlots * kStride, 0);
  CacheEntry e;
  e.layout = CacheLayout{tensors, kSlots * kStride, kSlots, blocks, Placement::kHost};
  for (uint32_t t = 0; t < tensors; ++t)
    e.addrs.push_back(reinterpret_cast<uint64_t>(mem->data()) + t * kSlots * kStride);
  e.blocks_model = model;
  e.remote_accessible = remote;
  return e;
}

RequestKey reqKey(uint64_t req, uint64_t model) { return RequestKey{req, kInvalidId, model}; }

// A read or write of blocks cache `model` (the registry's block size, kStride).
wire::TransferBody blocksBody(uint64_t model, std::vector<uint32_t> tensors, std::vector<wire::Run> runs) {
  wire::TransferBody b = body(wire::TargetKind::kBlocks, std::move(tensors), std::move(runs));
  b.target.model_id = model;
  b.block_size = kStride;
  return b;
}

// Raw ranges across many registrations (the hostile review's amplification: one range across 64
// contiguous caches, repeated in one request): one reference per distinct cache, the request's steps
// bounded by limits::kMaxRequestSpanSteps, and a writer let in while readers resolve such requests.
void rawSpanCases() {
  constexpr size_t kCaches = 64;
  const uint64_t tensor = kSlots * kStride;
  std::vector<uint8_t> mem(kCaches * tensor);
  const uint64_t base = reinterpret_cast<uint64_t>(mem.data());
  Registry reg;
  for (size_t i = 0; i < kCaches; ++i) {
    CacheEntry e;
    e.layout = CacheLayout{1, tensor, kSlots, false, Placement::kHost};
    e.addrs = {base + i * tensor};
    check(reg.add(std::move(e), {}).ok(), "raw spans: a cache that follows the last");
  }
  wire::TransferBody span;
  span.target.kind = wire::TargetKind::kRaw;
  span.tensors = {0};
  span.runs.assign(1000, wire::Run{base, kCaches * tensor});
  auto r = reg.resolve(span, false);
  check(r.ok() && r.value().keep.size() == kCaches && r.value().run_placements.size() == 1000,
        "raw spans: 1000 ranges across 64 caches keep 64 references, not 64,000");
  std::set<const CacheEntry*> distinct;
  for (const auto& e : r.ok() ? r.value().keep : std::vector<std::shared_ptr<CacheEntry>>{}) distinct.insert(e.get());
  check(distinct.size() == kCaches, "raw spans: each cache kept once");
  // Steps: exactly the bound passes, one more is refused, with the limit named.
  const uint64_t per_run = kCaches, max_runs = limits::kMaxRequestSpanSteps / per_run;
  span.runs.assign(max_runs, wire::Run{base, kCaches * tensor});
  r = reg.resolve(span, false);
  check(r.ok() && r.value().keep.size() == kCaches, "raw spans: a request of exactly max_request_span_steps steps");
  span.runs.push_back(wire::Run{base, 1});
  r = reg.resolve(span, false);
  checkCode(r.status(), Code::kParamInvalid, "raw spans: one step past max_request_span_steps");
  check(r.status().message().find("max_request_span_steps") != std::string::npos,
        "raw spans: the refusal names the limit: " + r.status().message());
  span.runs.assign(limits::kMaxRequestSpanSteps + 1, wire::Run{base, 1});
  checkCode(reg.resolve(span, false).status(), Code::kParamInvalid,
            "raw spans: more ranges than max_request_span_steps, refused before any is resolved");
  // The engine's own lists (planAbsolute) take the bound they pass.
  Resolved own;
  span.runs.assign(max_runs + 1, wire::Run{base, kCaches * tensor});
  check(reg.resolveRaw(span.runs, false, &own, UINT64_MAX).ok() && own.keep.size() == kCaches,
        "raw spans: a local list past the per-request bound, with no bound");
  // Writers first: while two threads resolve the largest such requests back to back, each add()
  // gets the lock within a batch or two, not after whole requests.
  span.runs.assign(max_runs, wire::Run{base, kCaches * tensor});
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> resolved{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        if (reg.resolve(span, false).ok()) resolved.fetch_add(1);
      }
    });
  }
  while (resolved.load() < 2) std::this_thread::yield();
  std::vector<uint8_t> extra(tensor);
  double worst_ms = 0;
  const auto t_request = std::chrono::steady_clock::now();
  (void)reg.resolve(span, false);
  const double request_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_request).count();
  for (int i = 0; i < 20; ++i) {
    CacheEntry e;
    e.layout = CacheLayout{1, tensor, kSlots, false, Placement::kHost};
    e.addrs = {reinterpret_cast<uint64_t>(extra.data())};
    const auto t0 = std::chrono::steady_clock::now();
    auto added = reg.add(std::move(e), {});
    worst_ms =
        std::max(worst_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    check(added.ok() && reg.unregister(added.value()->id).ok(), "raw spans: add and unregister while readers resolve");
  }
  stop.store(true);
  for (auto& t : readers) t.join();
  std::printf("  raw spans: one request of %llu steps resolves in %.1f ms; an add waited %.2f ms at worst\n",
              static_cast<unsigned long long>(limits::kMaxRequestSpanSteps), request_ms, worst_ms);
  check(worst_ms < std::max(50.0, request_ms / 4), "raw spans: an add waited " + std::to_string(worst_ms) +
                                                       " ms behind readers (a request takes " +
                                                       std::to_string(request_ms) + " ms)");
}

void registryCases() {
  Registry reg;
  std::vector<uint8_t> m1, m2, m3, m4;
  auto a = reg.add(userCache(&m1, 2, false, std::nullopt), {reqKey(1, 0), RequestKey{}, reqKey(2, 0)});
  auto b = reg.add(userCache(&m2, 2, true, 7), {});
  check(a.ok() && b.ok() && a.value()->id == 1 && b.value()->id == 2, "registry: ids count from 1 in call order");
  const uint64_t gen0 = reg.published()->generation.load();

  // refused adds change nothing, and do not use up an id
  checkCode(reg.add(userCache(&m3, 1, false, std::nullopt), {reqKey(9, 0), reqKey(2, 0)}).status(), Code::kParamInvalid,
            "registry: a key already bound");
  checkCode(reg.add(userCache(&m3, 1, false, std::nullopt), {reqKey(9, 0), reqKey(9, 0)}).status(), Code::kParamInvalid,
            "registry: a key repeated in one call");
  checkCode(reg.add(userCache(&m3, 1, false, std::nullopt), std::vector<RequestKey>(kSlots + 1, RequestKey{})).status(),
            Code::kParamInvalid, "registry: more keys than slots");
  checkCode(reg.add(userCache(&m3, 1, true, 7), {}).status(), Code::kParamInvalid,
            "registry: a second blocks cache under one model");
  check(reg.size() == 2, "registry: refused adds added nothing");
  wire::TransferBody by_key;
  by_key.target.kind = wire::TargetKind::kRequestKey;
  by_key.target.req_id = 9;
  by_key.tensors = {0};
  by_key.runs = {{0, 1}};
  checkCode(reg.resolve(by_key, false).status(), Code::kKvCacheNotExist,
            "registry: a key of a refused add was not bound");
  auto c = reg.add(userCache(&m3, 1, false, std::nullopt, /*remote=*/false), {});
  check(c.ok() && c.value()->id == 3, "registry: the next id after refusals is 3");

  // request keys: the slot's bytes, bounded by the stride; padding keys consume a slot
  by_key.target.req_id = 2;
  by_key.runs = {{16, kStride - 16}};
  auto r = reg.resolve(by_key, false);
  check(r.ok() && r.value().base == 2 * kStride && r.value().addrs == a.value()->addrs,
        "registry: request key 2 is slot 2 (the padding key took slot 1)");
  by_key.runs = {{16, kStride - 15}};
  checkCode(reg.resolve(by_key, false).status(), Code::kParamInvalid, "registry: a run one byte past the slot");
  by_key.runs = {{0, 0}};
  checkCode(reg.resolve(by_key, false).status(), Code::kParamInvalid, "registry: an empty run");
  by_key.runs = {{std::numeric_limits<uint64_t>::max(), 2}};
  checkCode(reg.resolve(by_key, false).status(), Code::kParamInvalid, "registry: a run that wraps around");
  by_key.runs = {{0, 1}};
  by_key.tensors = {2};
  checkCode(reg.resolve(by_key, false).status(), Code::kParamInvalid, "registry: tensor 2 of 2");
  by_key.tensors = {0};
  by_key.target.model_id = 1;
  checkCode(reg.resolve(by_key, false).status(), Code::kKvCacheNotExist, "registry: the key under another model");

  // id + batch index
  wire::TransferBody by_id = by_key;
  by_id.target.kind = wire::TargetKind::kIdIndex;
  by_id.target.cache_id = 1;
  by_id.target.batch_index = kSlots - 1;
  r = reg.resolve(by_id, false);
  check(r.ok() && r.value().base == (kSlots - 1) * kStride, "registry: id and the last batch index");
  by_id.target.batch_index = kSlots;
  checkCode(reg.resolve(by_id, false).status(), Code::kKvCacheNotExist, "registry: a batch index past the cache");
  by_id.target.batch_index = 0;
  by_id.target.cache_id = 3;
  checkCode(reg.resolve(by_id, true).status(), Code::kParamInvalid,
            "registry: a write into a cache not remote accessible");
  check(reg.resolve(by_id, false).ok(), "registry: a read of a cache not remote accessible");

  // blocks: the whole tensor, the block size checked
  r = reg.resolve(blocksBody(7, {0, 1}, {{3 * kStride, kStride}, {0, kStride}}), true);
  check(r.ok() && r.value().base == 0 && r.value().tensors.size() == 2 && r.value().runs.size() == 2,
        "registry: blocks 3 and 0 of both tensors");
  checkCode(reg.resolve(blocksBody(7, {0}, {{kSlots * kStride - 1, 2}}), false).status(), Code::kParamInvalid,
            "registry: a run past the blocks cache");
  wire::TransferBody wrong_size = blocksBody(7, {0}, {{0, kStride}});
  wrong_size.block_size = kStride * 2;
  checkCode(reg.resolve(wrong_size, false).status(), Code::kParamInvalid, "registry: a different block size");
  checkCode(reg.resolve(blocksBody(8, {0}, {{0, 1}}), false).status(), Code::kKvCacheNotExist,
            "registry: an unknown model");

  // raw addresses: inside one registered tensor only
  const uint64_t t1 = b.value()->addrs[1];
  wire::TransferBody raw;
  raw.target.kind = wire::TargetKind::kRaw;
  raw.tensors = {0};
  raw.runs = {{t1 + 8, kSlots * kStride - 8}};
  r = reg.resolve(raw, false);
  check(r.ok() && r.value().keep.size() == 1 && r.value().keep[0]->id == 2, "registry: a raw range inside a tensor");
  raw.runs = {{t1 + 8, kSlots * kStride - 7}};
  checkCode(reg.resolve(raw, false).status(), Code::kParamInvalid, "registry: a raw range one byte past its tensor");
  // across two tensors where the second starts exactly where the first ends (userCache lays them
  // out so): allowed; from the last one on into unregistered memory: refused
  raw.runs = {{b.value()->addrs[0] + kSlots * kStride - 4, 8}};
  r = reg.resolve(raw, false);
  check(r.ok() && r.value().keep.size() == 1 && r.value().keep[0]->id == 2,
        "registry: a raw range across two tensors that follow each other (one cache, one reference)");
  raw.runs = {{t1 + kSlots * kStride - 4, 8}};
  checkCode(reg.resolve(raw, false).status(), Code::kParamInvalid,
            "registry: a raw range from a tensor into unregistered memory");
  // rows (wire v10): a row is checked by its span, and each of its runs gets its placement
  auto decoded = [](const wire::TransferBody& body) {
    std::string f = wire::encode(body);
    wire::TransferBody out;
    checkCode(wire::decode(bytes(f), f.size(), &out), Code::kSuccess, "registry: a body of rows decoded");
    return out;
  };
  raw.runs = {{t1, 8}, {t1 + 64, 8}, {t1 + 128, 8}};
  wire::TransferBody as_rows = decoded(raw);
  r = reg.resolve(as_rows, false);
  check(as_rows.rows.size() == 1 && r.ok() && r.value().runs.size() == 3 && r.value().run_placements.size() == 3,
        "registry: a raw row, a placement per run");
  const uint64_t tensor_end = t1 + kSlots * kStride;
  raw.runs = {{tensor_end - 24, 8}, {tensor_end - 8, 8}, {tensor_end + 8, 8}};
  checkCode(reg.resolve(decoded(raw), false).status(), Code::kParamInvalid,
            "registry: a raw row whose last run is outside its tensor");
  {  // runs in two caches with unregistered memory between them: the span fails, the runs pass
    const uint64_t x = a.value()->addrs[0], y = b.value()->addrs[0], lo = std::min(x, y), hi = std::max(x, y);
    wire::TransferBody gap = raw;
    gap.runs = {{lo + 8, 8}, {hi + 8, 8}};
    gap.rows = {{lo + 8, 8, hi - lo, 2}};
    r = reg.resolve(gap, false);
    check(r.ok() && r.value().keep.size() == 2 && r.value().run_placements.size() == 2,
          "registry: a raw row over unregistered memory is checked run by run");
  }
  checkCode(reg.resolve(decoded(blocksBody(7, {0}, {{0, 8}, {kStride, 8}, {2 * kStride, 8}})), false).status(),
            Code::kSuccess, "registry: a row of blocks");
  r = reg.resolve(
      decoded(blocksBody(7, {0}, {{(kSlots - 2) * kStride, 8}, {(kSlots - 1) * kStride, 8}, {kSlots * kStride, 8}})),
      false);
  checkCode(r.status(), Code::kParamInvalid, "registry: a row of blocks whose last run is past the cache");
  check(r.status().message().find("+" + std::to_string(2 * kStride + 8) + ")") != std::string::npos,
        "registry: the refusal names the row's span: " + r.status().message());
  {  // a range across at most limits::kMaxRawSpan (64) tensors that follow each other
    Registry wide;
    std::vector<uint8_t> mw;
    check(wide.add(userCache(&mw, 65, false, std::nullopt), {}).ok(), "registry: a cache of 65 tensors");
    const uint64_t tensor = kSlots * kStride, base = reinterpret_cast<uint64_t>(mw.data());
    wire::TransferBody span = raw;
    span.runs = {{base, 64 * tensor}};
    r = wide.resolve(span, false);
    check(r.ok() && r.value().keep.size() == 1, "registry: a raw range across 64 tensors of one cache");
    span.runs = {{base, 64 * tensor + 1}};
    checkCode(wide.resolve(span, false).status(), Code::kParamInvalid, "registry: a raw range across 65 tensors");
  }
  rawSpanCases();
  {  // each raw range resolves to one placement: HOST and DEVICE registrations that follow each other
    Registry mixed;
    std::vector<uint8_t> mem(2 * kSlots * kStride);
    const uint64_t tensor = kSlots * kStride, base = reinterpret_cast<uint64_t>(mem.data());
    for (uint32_t i = 0; i < 2; ++i) {
      CacheEntry e;
      e.layout = CacheLayout{1, tensor, kSlots, false, i == 0 ? Placement::kHost : Placement::kDevice};
      e.addrs = {base + i * tensor};
      check(mixed.add(std::move(e), {}).ok(), "registry: a HOST and a DEVICE cache that follow each other");
    }
    wire::TransferBody runs = raw;
    runs.runs = {{base + tensor + 8, 16}, {base, 8}, {base + 8, tensor - 8}};
    r = mixed.resolve(runs, false);
    check(r.ok() && r.value().run_placements ==
                        std::vector<Placement>{Placement::kDevice, Placement::kHost, Placement::kHost},
          "registry: each raw range's placement");
    runs.runs = {{base + tensor - 4, 8}};
    checkCode(mixed.resolve(runs, false).status(), Code::kParamInvalid,
              "registry: a raw range across a HOST and a DEVICE registration");
  }
  raw.runs = {{reinterpret_cast<uint64_t>(&gen0), 8}};
  checkCode(reg.resolve(raw, false).status(), Code::kParamInvalid, "registry: a raw range outside every cache");
  raw.runs = {{c.value()->addrs[0], 8}};
  checkCode(reg.resolve(raw, true).status(), Code::kParamInvalid, "registry: a raw write into a read-only cache");
  raw.tensors = {0, 1};
  checkCode(reg.resolve(raw, false).status(), Code::kParamInvalid, "registry: a raw transfer of two tensors");

  // describe, and the generation a same-host peer watches
  auto d = reg.describe(7);
  check(d.ok() && d.value().stride == kStride && d.value().tensor_size == kSlots * kStride &&
            d.value().addrs == b.value()->addrs && d.value().generation == reg.published()->generation.load(),
        "registry: describe a blocks cache");
  checkCode(reg.describe(8).status(), Code::kKvCacheNotExist, "registry: describe an unknown model");
  check(reg.published()->generation.load() == gen0, "registry: adds and resolves leave the generation alone");

  // unregister: keys and indexes go, the generation moves
  checkCode(reg.unregister(1).status(), Code::kSuccess, "registry: unregister cache 1");
  check(reg.published()->generation.load() > gen0, "registry: unregister bumps the generation");
  by_key.target.model_id = 0;
  checkCode(reg.resolve(by_key, false).status(), Code::kKvCacheNotExist, "registry: keys of an unregistered cache");
  raw.tensors = {0};
  raw.runs = {{a.value()->addrs[0], 8}};
  checkCode(reg.resolve(raw, false).status(), Code::kParamInvalid, "registry: raw addresses of an unregistered cache");
  checkCode(reg.unregister(1).status(), Code::kParamInvalid, "registry: unregister twice");
  auto again = reg.add(userCache(&m4, 1, false, std::nullopt), {reqKey(1, 0)});
  check(again.ok() && again.value()->id == 4, "registry: a freed key binds again, under a new id");
  checkCode(reg.unregister(2).status(), Code::kSuccess, "registry: unregister the blocks cache");
  checkCode(reg.describe(7).status(), Code::kKvCacheNotExist, "registry: describe after unregister");
}

void poolLifetimeCases() {
  auto backend = makeCpuBackend();
  auto pool = MemPool::create(backend, Placement::kHost, 64 * 1024, 12);
  check(pool.ok(), "registry pool: create");
  if (!pool.ok()) return;
  std::shared_ptr<MemPool> p = pool.value();
  Registry reg;
  auto owned = [&](std::vector<RequestKey> keys) {
    CacheEntry e;
    e.layout = CacheLayout{2, kSlots * kStride, kSlots, false, Placement::kHost};
    for (int t = 0; t < 2; ++t) e.addrs.push_back(p->allocate(e.layout.tensor_size).value());
    e.owned = true;
    e.pool = p;
    return reg.add(std::move(e), keys);
  };
  int64_t id = 0;
  {  // the test's own reference ends here
    auto a = owned({reqKey(5, 0)});
    check(a.ok() && p->used() == 2 * 4096, "registry pool: an allocated cache holds two pages");
    if (!a.ok()) return;
    id = a.value()->id;
  }
  checkCode(reg.unregister(id).status(), Code::kParamInvalid, "registry pool: unregister of an allocated cache");
  checkCode(reg.deallocate(id, /*expect_blocks=*/true), Code::kParamInvalid, "registry pool: the wrong deallocate");
  checkCode(reg.deallocate(id, false), Code::kSuccess, "registry pool: deallocate");
  check(p->used() == 2 * 4096 && reg.size() == 1, "registry pool: a bound request key keeps the memory");
  // a transfer that resolved it keeps it alive past the key's release
  wire::TransferBody by_key;
  by_key.target.kind = wire::TargetKind::kRequestKey;
  by_key.target.req_id = 5;
  by_key.tensors = {0, 1};
  by_key.runs = {{0, kStride}};
  {
    auto in_flight = reg.resolve(by_key, false);
    check(in_flight.ok(), "registry pool: resolve by the request key");
    reg.commitRead(by_key.target, {0});
    check(reg.size() == 1, "registry pool: one tensor of two read: the key stays");
    reg.commitRead(by_key.target, {1});
    check(reg.size() == 0, "registry pool: both tensors read: the cache leaves the registry");
    check(p->used() == 2 * 4096, "registry pool: the in-flight transfer still holds the memory");
  }
  check(p->used() == 0, "registry pool: the memory is back in the pool when the transfer ends");

  // removeKey and deallocate, in either order, free it once
  int64_t bid = 0;
  {
    auto b = owned({reqKey(6, 0)});
    if (!b.ok()) return check(false, "registry pool: a second allocated cache");
    bid = b.value()->id;
  }
  reg.removeKey(reqKey(6, 0));
  check(p->used() == 2 * 4096, "registry pool: the id reference keeps the memory");
  checkCode(reg.deallocate(bid, false), Code::kSuccess, "registry pool: deallocate after removeKey");
  checkCode(reg.deallocate(bid, false), Code::kSuccess, "registry pool: a second deallocate is a no-op");
  check(p->used() == 0 && reg.size() == 0, "registry pool: freed once");
}

// ---------------------------------------------------------------- memory pool

void memPoolCases() {
  auto backend = makeCpuBackend();
  checkCode(MemPool::create(backend, Placement::kHost, 0, 12).status(), Code::kParamInvalid, "pool: size 0");
  checkCode(MemPool::create(backend, Placement::kHost, 4096, 9).status(), Code::kParamInvalid, "pool: page_shift 9");
  checkCode(MemPool::create(backend, Placement::kHost, 4096, 31).status(), Code::kParamInvalid, "pool: page_shift 31");
  auto created = MemPool::create(backend, Placement::kHost, 16 * 4096, 12);
  check(created.ok(), "pool: create 16 pages");
  if (!created.ok()) return;
  std::shared_ptr<MemPool> pool = created.value();
  check(pool->capacity() == 16 * 4096 && pool->used() == 0, "pool: capacity and use");

  std::vector<uint64_t> got;
  for (uint64_t bytes : {uint64_t{1}, uint64_t{4096}, uint64_t{4097}, uint64_t{0}}) {
    auto a = pool->allocate(bytes);
    check(a.ok(), "pool: allocate " + std::to_string(bytes));
    if (a.ok()) got.push_back(a.value());
  }
  check(pool->used() == (1 + 1 + 2 + 1) * 4096, "pool: sizes rounded up to whole pages (0 takes one)");
  std::set<uint64_t> distinct(got.begin(), got.end());
  bool aligned = true, inside = true;
  for (uint64_t a : got) {
    aligned = aligned && (a - pool->base()) % 4096 == 0;
    inside = inside && a >= pool->base() && a < pool->base() + pool->capacity();
  }
  check(distinct.size() == got.size() && aligned && inside, "pool: distinct, page-aligned, inside the region");
  check(got.size() == 4 && got[3] - got[2] >= 2 * 4096, "pool: the 2-page allocation does not overlap the next");

  checkCode(pool->allocate(12 * 4096).status(), Code::kOutOfMemory, "pool: more than is free");
  for (uint64_t huge :
       {uint64_t{17} * 4096, std::numeric_limits<uint64_t>::max(), std::numeric_limits<uint64_t>::max() - 4094}) {
    checkCode(pool->allocate(huge).status(), Code::kOutOfMemory, "pool: allocate " + std::to_string(huge));
  }
  check(pool->used() == 5 * 4096, "pool: refused allocations took nothing");
  auto rest = pool->allocate(11 * 4096);
  check(rest.ok() && pool->used() == pool->capacity(), "pool: exactly what is left");
  if (!rest.ok() || got.size() != 4) return;
  checkCode(pool->allocate(1).status(), Code::kOutOfMemory, "pool: full");

  // release in an order that needs merges on both sides; then the whole region is one range again
  pool->release(got[1]);
  pool->release(got[3]);
  pool->release(got[2]);  // between the two freed ranges
  pool->release(got[0]);
  pool->release(rest.value());
  pool->release(rest.value());      // twice: a no-op
  pool->release(pool->base() - 1);  // not an allocation: a no-op
  check(pool->used() == 0, "pool: everything released");
  auto whole = pool->allocate(pool->capacity());
  check(whole.ok() && whole.value() == pool->base(), "pool: released neighbours merged back into one range");
}

// ---------------------------------------------------------------- status scopes

void statusScopeCases() {
  for (Code c :
       {Code::kNotYetLink, Code::kAlreadyLink, Code::kLinkFailed, Code::kUnlinkFailed, Code::kNotifyPromptUnlinkFailed,
        Code::kProcessingLink, Code::kLinkBusy, Code::kTimeout, Code::kWaitProcessTimeout}) {
    check(Status(c, "x").scope() == Scope::kLink, std::string("link scope of ") + codeName(c));
  }
  for (Code c : {Code::kEngineFinalized, Code::kOutOfMemory, Code::kDeviceOutOfMemory, Code::kBlocksOutOfMemory,
                 Code::kNoFreeBlock}) {
    check(Status(c, "x").scope() == Scope::kEngine, std::string("engine scope of ") + codeName(c));
  }
  for (Code c : {Code::kFailed, Code::kParamInvalid, Code::kFeatureNotEnabled, Code::kKvCacheNotExist, Code::kExistLink,
                 Code::kClusterNumExceedLimit}) {
    check(Status(c, "x").scope() == Scope::kCall, std::string("call scope of ") + codeName(c));
  }
  check(Status::OK().scope() == Scope::kCall, "OK's scope");
  Status explicit_scope(Code::kFailed, Scope::kEngine, "engine is not initialized");
  check(explicit_scope.scope() == Scope::kEngine && explicit_scope.code() == Code::kFailed, "an explicit scope");
  Status copy = explicit_scope;
  check(copy.scope() == Scope::kEngine, "a copy keeps the scope");
  check(std::string(scopeName(Scope::kLink)) == "LINK", "scope names");
}

// Telemetry (engine/telemetry.h): a value on a bucket's bound lands in that bucket; the peers past
// the cap count as "other"; counts from many threads add up exactly; failures by code and stage;
// EngineStats::since subtracts counts and keeps series new since the earlier snapshot whole.
void telemetryCases() {
  Telemetry t(2);
  check(&t.peer(7) == &t.peer(1234), "a peer never linked counts as other");
  t.linkUp(7);
  Telemetry::Peer& a = t.peer(7);
  check(&t.peer(7) == &a && &a != &t.peer(1234), "a linked peer has counters of its own, found again");
  t.transferDone(a, "tcp", false, 100, 2, 10'000, 0, 10'001);    // 10 us (on the first bound), 0, just above it
  t.transferDone(a, "tcp", false, 50, 1, 60'000'000'001, 1, 1);  // past the last bound: +Inf
  TelemetrySnapshot s = t.snapshot();
  check(s.transfers.size() == 1 && s.transfers[0].peer == "7" && s.transfers[0].path == "tcp" &&
            s.transfers[0].op == "pull" && s.transfers[0].transfers == 2 && s.transfers[0].bytes == 150 &&
            s.transfers[0].descriptors == 3,
        "one series with the counts");
  const HistogramCounts& q = s.transfers[0].queue;
  check(q.buckets.size() == kLatencyBuckets && q.buckets[0] == 1 && q.buckets.back() == 1 && q.count == 2,
        "a value on a bound is in its bucket, one past the last in +Inf");
  check(s.transfers[0].total.buckets[1] == 1, "10.001 us is in the 25 us bucket");
  t.linkUp(8);
  t.linkUp(9);  // past the cap of 2 (7 and 8): counted as other
  t.transferDone(t.peer(8), "cma", true, 1, 1, 1, 1, 2);
  t.transferDone(t.peer(9), "cma", true, 4, 1, 1, 1, 2);   // past the cap of 2
  t.transferDone(t.peer(10), "cma", true, 8, 1, 1, 1, 2);  // so is this one
  t.transferFailed(t.peer(10), "none", false, Code::kNotYetLink, TransferStage::kAdmission);
  t.transferFailed(t.peer(7), "tcp", false, Code::kTimeout, TransferStage::kPayload);
  t.transferFailed(t.peer(7), "tcp", false, Code::kTimeout, TransferStage::kPayload);
  t.linkDown(8, LinkDown::kUnlinked);
  t.linkUp(8);
  EngineStats first;
  s = t.snapshot();
  first.transfers = s.transfers;
  first.failures = s.failures;
  first.link_events = s.link_events;
  uint64_t other_bytes = 0;
  for (const TransferSeries& x : s.transfers) {
    if (x.peer == "other") other_bytes += x.bytes;
  }
  check(other_bytes == 12 && s.transfers.size() == 3, "peers 9 and 10 are counted together as other");
  check(s.failures.size() == 2, "failures by series");
  for (const FailureSeries& f : s.failures) {
    check((f.peer == "other" && f.code == "LLM_NOT_YET_LINK" && f.stage == "admission" && f.count == 1) ||
              (f.peer == "7" && f.code == "LLM_TIMEOUT" && f.stage == "payload" && f.count == 2),
          "a failure's code and stage");
  }
  std::set<std::tuple<std::string, std::string, std::string, uint64_t>> events;
  for (const LinkEventSeries& e : s.link_events) events.insert({e.peer, e.event, e.reason, e.count});
  check(events == decltype(events){{"7", "up", "", 1},
                                   {"8", "up", "", 2},
                                   {"8", "reconnect", "", 1},
                                   {"8", "down", "unlinked", 1},
                                   {"other", "up", "", 1}},
        "link events");
  // many threads on one series: every count lands
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&t] {
      for (int k = 0; k < 10000; ++k) t.transferDone(t.peer(7), "tcp", false, 1, 1, 1, 1, 2);
    });
  }
  for (std::thread& th : threads) th.join();
  EngineStats later;
  s = t.snapshot();
  later.transfers = s.transfers;
  later.failures = s.failures;
  later.link_events = s.link_events;
  EngineStats d = later.since(first);
  for (const TransferSeries& x : d.transfers) {
    if (x.peer == "7") {
      check(x.transfers == 40000 && x.bytes == 40000 && x.total.count == 40000 && x.total.buckets[0] == 40000,
            "40000 transfers from 4 threads, and only they, in the delta");
    } else {
      check(x.transfers == 0 && x.bytes == 0, "an unchanged series is 0 in the delta");
    }
  }
}

}  // namespace

int main() {
  statusScopeCases();
  requestHeaderCases();
  responseHeaderCases();
  transferBodyCases();
  rowCases();
  notifyBodyCases();
  ucxCases();
  descriptorAndAnswerCases();
  registryCases();
  poolLifetimeCases();
  memPoolCases();
  telemetryCases();
  std::fprintf(stderr, testing::failures ? "unit_test: %d failure(s)\n" : "unit_test: every check passed\n",
               testing::failures);
  return testing::failures ? 1 : 0;
}
