// Writes the seed corpus of wire_fuzz: valid frames made by the real encoders, each prefixed with
// its selector byte (fuzz_fixture.h), several addressing the fixture's caches so that the fuzzer
// starts from accesses the registry accepts. Generated at build time, so the seeds follow the
// protocol when it changes.
//
// Usage: make_seeds DIR
#include <cstdio>
#include <string>
#include <vector>

#include "fuzz/fuzz_fixture.h"

using namespace pdlink;
using namespace pdlink::fuzz;

namespace {

std::string dir;
int written = 0;

void seed(const std::string& name, uint8_t mode, const std::string& bytes) {
  std::string path = dir + "/" + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) {
    std::perror(path.c_str());
    std::exit(1);
  }
  std::fputc(mode, f);
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  ++written;
}

wire::TransferBody body(wire::TargetKind kind, std::vector<uint32_t> tensors, std::vector<wire::Run> runs) {
  wire::TransferBody b;
  b.target.kind = kind;
  b.tensors = std::move(tensors);
  b.runs = std::move(runs);
  return b;
}

// A frame step: the request, and for a write in the stream its payload (0x22 bytes).
std::string frame(wire::Op op, const wire::TransferBody& b, uint8_t flags = 0) {
  std::string encoded = wire::encode(b);
  wire::RequestHeader h;
  h.op = op;
  h.flags = flags;
  h.body_len = static_cast<uint32_t>(encoded.size());
  if (op == wire::Op::kWrite && !flags) h.payload_len = b.payloadBytes().value();
  return std::string(1, static_cast<char>(kStepFrame)) + wire::encode(h) + encoded +
         std::string(static_cast<size_t>(h.payload_len), '\x22');
}

// A frame of `op` with an already encoded body.
std::string bodyFrame(wire::Op op, const std::string& encoded) {
  return std::string(1, static_cast<char>(kStepFrame)) +
         wire::encode(wire::RequestHeader{op, static_cast<uint32_t>(encoded.size()), 0}) + encoded;
}

std::string notifyFrame(const wire::NotifyBody& b) { return bodyFrame(wire::Op::kNotify, wire::encode(b)); }

// A kPathConnect frame naming `path`, with the path's setup body.
std::string pathConnectFrame(uint8_t path, const std::string& setup) {
  return bodyFrame(wire::Op::kPathConnect, wire::pathConnectBody(path, setup));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  dir = argv[1];

  wire::Hello hello;
  hello.cluster_id = 1;
  hello.expected_peer = wire::kAnyCluster;
  hello.nonce = {0x12, 0x34, 0x56, 0x78, 0x90, 0xAB, 0xCD, 0xEF, 1, 2, 3, 4, 5, 6, 7, 8};
  hello.flags = wire::kHelloSameHost;
  seed("hello", kModeHello, wire::encode(hello));
  hello.channel = wire::Channel::kReverse;
  hello.flags = 0;
  seed("hello-reverse", kModeHello, wire::encode(hello));
  hello.channel = wire::Channel::kLane;
  seed("hello-lane", kModeHello, wire::encode(hello));

  wire::ClientAuth client;
  client.hint.pid_ns = 4026531836ull;
  for (int i = 0; i < 16; ++i) client.hint.boot_id[i] = static_cast<uint8_t>(i * 17);
  client.gen_addr = 0x7f0000001000ull;
  seed("client-auth", kModeClientAuth, wire::encode(client));

  wire::HelloAck ack;
  ack.cluster_id = 2;
  seed("hello-ack", kModeHelloAck, wire::encode(ack));
  ack.status = static_cast<uint32_t>(Code::kLinkFailed);
  ack.message = "refused: wrong cluster id";
  seed("hello-ack-refused", kModeHelloAck, wire::encode(ack));

  wire::AuthResult auth;
  seed("auth-ok", kModeAuthResult, wire::encode(auth));
  auth.redirect = "pdlink-00112233445566778899aabbccddeeff";
  seed("auth-redirect", kModeAuthResult, wire::encode(auth));
  auth.redirect.clear();
  auth.flags = wire::kAuthPayloadIntegrity;
  for (size_t i = 0; i < sizeof(auth.tag); ++i) auth.tag[i] = static_cast<uint8_t>(i * 17);
  seed("auth-integrity", kModeAuthResult, wire::encode(auth));
  auth.flags = 0;
  auth.status = static_cast<uint32_t>(Code::kLinkFailed);
  auth.message = "authentication failed";
  seed("auth-refused", kModeAuthResult, wire::encode(auth));

  wire::RequestHeader req;
  req.op = wire::Op::kWrite;
  req.body_len = 61;
  req.payload_len = 4096;
  seed("request-write", kModeRequest, wire::encode(req));
  req.op = wire::Op::kPathConnect;
  req.body_len = wire::kPathConnectHeaderBytes + 4109;  // the path's id, an HCCL root info and the options byte
  req.payload_len = 0;
  seed("request-path-connect", kModeRequest, wire::encode(req));
  req.op = wire::Op::kRead;
  req.body_len = 61;
  req.flags = wire::kFlagDevice | wire::kFlagOneSided;
  seed("request-one-sided", kModeRequest, wire::encode(req));
  req.flags = 0;
  req.epoch_tag = wire::epochTagOf(3);  // a prepared transfer's fenced read
  seed("request-epoch-tag", kModeRequest, wire::encode(req));
  req.epoch_tag = wire::epochTagOf(0x12345678);  // v8: a tag past v7's 16 bits
  seed("request-epoch-tag-wide", kModeRequest, wire::encode(req));
  wire::ResponseHeader resp;
  resp.status = static_cast<uint32_t>(Code::kParamInvalid);
  resp.message_len = 12;
  seed("response", kModeResponse, wire::encode(resp));
  resp.status = static_cast<uint32_t>(Code::kStaleEpoch);
  resp.epoch_tag = wire::epochTagOf(4);
  seed("response-stale-epoch", kModeResponse, wire::encode(resp));
  resp.epoch_tag = wire::epochTagOf(uint64_t{0xFFFFFFFE});  // v8: the largest tag
  seed("response-stale-epoch-wide", kModeResponse, wire::encode(resp));

  wire::CacheDescriptor desc;
  desc.generation = 7;
  desc.tensor_size = 256;
  desc.stride = 32;
  desc.addrs = {0x7f0000001000ull, 0x7f0000002000ull, 0x7f0000003000ull};
  seed("descriptor", kModeDescriptor, wire::encode(desc));

  // Answers a requester reads: a direct-access answer for 3 pieces, 2 one-sided addresses, an IPC
  // answer for 2 tensors x 2 runs ([16, +32) and [64, +16): a span of 64 bytes from offset 16).
  wire::DirectAnswer direct;
  direct.pin_epoch = 3;
  direct.epoch_addr = 0x7f0000000010ull;
  direct.addrs = {0x7f0000001000ull, 0x7f0000001040ull, 0x7f0000002000ull};
  direct.lengths = {64, 64, 128};
  seed("direct-answer", kModeDirectAnswer, std::string("\x03\x00", 2) + wire::encode(direct));
  seed("addresses", kModeAddresses, std::string("\x02\x00", 2) + std::string(16, '\x01'));
  wire::IpcAnswer ipc;
  ipc.keys = {"ipc-key-0", "ipc-key-1"};
  ipc.spans = {64, 64};
  seed("ipc-answer", kModeIpcAnswer, std::string("\x01\x01\x10\x00\x1f\x00\x40\x00\x0f\x00", 10) + wire::encode(ipc));

  seed("notify", kModeNotify, wire::encode(wire::NotifyBody{"req-1", "kv ready"}));
  seed("raw-table", kModeRawTable, wire::encode(wire::RawTable{7, {{0x1000, 4096}, {0x1000, 64}, {0x9000, 8192}}}));

  // UCX worker addresses as UCX 1.22 made them on a 2-core VM (tcp on lo and an address of
  // TEST-NET; the any-transport worker's sysv, posix, cma, self): v1 (UCX's default) of the network
  // and any-transport workers, v2 (UCX_ADDRESS_VERSION=v2) of both, v1 with debug info (its name).
  // The first byte picks UCX 1.22 (ucx::kAddressMinorFirst + 10).
  auto hex = [](const std::string& h) {
    std::string out;
    for (size_t i = 0; i + 1 < h.size(); i += 2) out += static_cast<char>(std::stoi(h.substr(i, 2), nullptr, 16));
    return out;
  };
  const std::string ucx122(1, '\x0a');
  seed("ucx-address-v1-network", kModeUcxAddress,
       ucx122 + hex("208cbb089ec7c42fe400060002c0000202cf1917b751389763344bd7e037370013230082e13d000e0102ac88c7aa08e6"
                    "52a6f9ffffefcf1917b75138539e3e4bd7e037370113230082b5638680"));
  seed("ucx-address-v1-any", kModeUcxAddress,
       ucx122 + hex("20257022df8ea29caa0000637577cc2b320040975000000000004f030088d5f7fb8d2c97cd7d01060002c0000202cf19"
                    "17b751389763344bd7e037370013230082e045010e0102ac88c7aa08e652a6f9ffffefcf1917b75138539e3e4bd7e037"
                    "370113230082ce130208ac88c7aa08e652268d5377cc2b320000705077ccab33004f23008837802d00000000000308ac"
                    "88c7aa08e65226a7d377cc2b320000705077ccab33004f230088904600c0030000c00408ac88c7aa08e65226478bbd37"
                    "063600242e5077ccab330092210084904600008680"));
  seed("ucx-address-v2-network", kModeUcxAddress,
       ucx122 + hex("61022121617344c70db700060002c0000202cf190c015a0080008b0082ea5d008e0102ac88c7aa08e652a6f9ffffefcf"
                    "190c015a0180008b0082c31f"));
  seed("ucx-address-v2-any", kModeUcxAddress,
       ucx122 + hex("61028fc41f4b0722d44c000063754426000080001b00885b959bcbab67775101060002c0000202cf190c015a0080008b"
                    "0082ea67010e0102ac88c7aa08e652a6f9ffffefcf190c015a0180008b0082a32d0208ac88c7aa08e652268d5344e543"
                    "0081009b00883d802d00000000000308ac88c7aa08e65226a7d344e5430081009b0088944600c0030000c00488ac88c7"
                    "aa08e65226478bfb554300000099008494460000"));
  seed("ucx-address-v1-debug-info-network", kModeUcxAddress,
       ucx122 + hex("30121628608cb3963c08766d3a313830383400060002c0000202cf1917b751389763344bd7e037370013230082e5fd00"
                    "0e0102ac88c7aa08e652a6f9ffffefcf1917b75138539e3e4bd7e037370113230082bdc78680"));

  // Transfer bodies that the fixture accepts, one per target kind.
  using K = wire::TargetKind;
  wire::TransferBody blocks = body(K::kBlocks, {0, 2}, {{32, 64}, {160, 32}});
  blocks.block_size = 32;
  seed("body-blocks", kModeBody, wire::encode(blocks));
  wire::TransferBody blocks7 = body(K::kBlocks, {0}, {{0, 256}});
  blocks7.target.model_id = 7;
  seed("body-blocks-pool", kModeBody, wire::encode(blocks7));
  wire::TransferBody reqkey = body(K::kRequestKey, {0, 1}, {{0, 64}});
  reqkey.target.req_id = 1;
  seed("body-request-key", kModeBody, wire::encode(reqkey));
  wire::TransferBody poolkey = body(K::kRequestKey, {0, 1}, {{0, 100}});
  poolkey.target.req_id = 5;
  seed("body-request-key-pool", kModeBody, wire::encode(poolkey));
  wire::TransferBody prefix = body(K::kPrefixKey, {1}, {{8, 56}});
  prefix.target.prefix_id = 4;
  prefix.target.model_id = 1;
  seed("body-prefix-key", kModeBody, wire::encode(prefix));
  wire::TransferBody byid = body(K::kIdIndex, {0}, {{0, 33}});
  byid.target.cache_id = 5;
  byid.target.batch_index = 2;
  seed("body-id-index", kModeBody, wire::encode(byid));
  seed("body-raw", kModeBody, wire::encode(body(K::kRaw, {0}, {{kRawTensorAddr + 10, 90}})));
  // runs in arithmetic progression go as rows (wire v10)
  wire::TransferBody rows = body(K::kBlocks, {0, 2}, {{32, 16}, {64, 16}, {96, 16}, {8, 4}, {8, 4}, {8, 4}});
  rows.block_size = 32;
  seed("body-rows", kModeBody, wire::encode(rows));
  seed("body-raw-rows", kModeBody,
       wire::encode(body(K::kRaw, {0}, {{kRawTensorAddr, 8}, {kRawTensorAddr + 20, 8}, {kRawTensorAddr + 40, 8}})));
  wire::TransferBody offer = body(K::kOffer, {0}, {{32, 64}});  // a KV handoff's offer (engine/offers.h)
  offer.target.model_id = 7;
  offer.target.req_id = 1;
  offer.target.prefix_id = 0x5a5a5a5a5a5a5a5a;
  offer.block_size = 32;
  seed("body-offer", kModeBody, wire::encode(offer));

  // A session through the serving loop: read and commit by key (which frees the pooled slot's key),
  // a direct read, device flags, a describe, the memory table and a read by address, a write, a notification,
  // local removals, and reads after them. Served on a link that is not same-host (first byte 0: the direct
  // read and describe must be refused) and on one that is (1).
  std::string s;
  s += frame(wire::Op::kRead, poolkey);
  s += frame(wire::Op::kCommit, poolkey);
  s += frame(wire::Op::kRead, blocks, wire::kFlagDirect);
  s += frame(wire::Op::kRead, blocks, wire::kFlagDevice);                        // HCCL two-sided
  s += frame(wire::Op::kWrite, blocks, wire::kFlagDevice | wire::kFlagDirect);   // same-host IPC
  s += frame(wire::Op::kRead, blocks, wire::kFlagDevice | wire::kFlagOneSided);  // HCCL one-sided
  s += frame(wire::Op::kDescribe, blocks7);
  s += frame(wire::Op::kDescribe, body(K::kRaw, {}, {}));  // the memory table, answered on any link
  s += frame(wire::Op::kRead, body(K::kRaw, {0}, {{kRawTensorAddr + 10, 90}}));
  s += frame(wire::Op::kRead, rows);
  s += frame(wire::Op::kWrite, reqkey);
  s += frame(wire::Op::kRead, blocks, wire::kFlagUcx);  // an engine without the ucx path refuses it
  // Path connects a CPU engine without ucx refuses, the link kept: ucx's, a device channel's.
  s += pathConnectFrame(wire::kFlagUcx, wire::encode(wire::UcxHello{7, 0, std::string(40, 'a')}));
  // (a short rendezvous: the fuzzer's inputs are at most 4 KiB, .ci/fuzz.sh)
  s += pathConnectFrame(wire::kFlagDevice, std::string(16, '\x5a') + '\x01');
  s += notifyFrame(wire::NotifyBody{"req-11", "written"});
  s += std::string{static_cast<char>(kStepDeallocate), 3, 0};
  s += std::string{static_cast<char>(kStepRemoveKey), 6, 6, 2};
  s += std::string{static_cast<char>(kStepUnregister), 1};
  s += bodyFrame(wire::Op::kConfirm, std::string(sizeof(wire::Nonce), '\x5a'));  // a link it did not dial
  s += frame(wire::Op::kRead, reqkey);
  s += frame(wire::Op::kRead, byid);
  seed("serve-tcp", kModeServe, std::string(1, '\0') + s);
  seed("serve-same-host", kModeServe, std::string(1, '\1') + s);
  // Path connects that drop the link, after a ping: one naming a path without a setup frame (the
  // stream's), one naming no path, a short header, one past the named path's bound.
  const std::string ping = bodyFrame(wire::Op::kPing, "");
  seed("serve-path-connect-no-setup", kModeServe, std::string(1, '\0') + ping + pathConnectFrame(0, "x"));
  seed("serve-path-connect-unknown", kModeServe, std::string(1, '\0') + ping + pathConnectFrame(0x80, "x"));
  seed("serve-path-connect-short", kModeServe, std::string(1, '\0') + ping + bodyFrame(wire::Op::kPathConnect, ""));
  // (announced, with only the path's header sent: the link is dropped before the rest is read)
  const wire::RequestHeader oversized{wire::Op::kPathConnect, 1 + wire::kMaxUcxHelloBytes + 1, 0};
  // KV handoffs: a read and a commit of an offer (refused: none is offered), a hold and an abort
  // (acknowledged), then a hold whose count is past its entries (the link is dropped).
  wire::HandoffBody abort{wire::HandoffBody::kAbort, "req-11", "gone", {}};
  wire::HandoffBody hold{wire::HandoffBody::kHold, "", "", {{1, 2}, {3, 4}}};
  std::string bad_hold = wire::encode(hold);
  bad_hold[1] = 3;
  seed("serve-handoff", kModeServe,
       std::string(1, '\0') + frame(wire::Op::kRead, offer) + frame(wire::Op::kCommit, offer) +
           bodyFrame(wire::Op::kHandoff, wire::encode(hold)) + bodyFrame(wire::Op::kHandoff, wire::encode(abort)) +
           bodyFrame(wire::Op::kHandoff, bad_hold));
  seed("serve-path-connect-oversized", kModeServe,
       std::string(1, '\0') + ping + std::string(1, static_cast<char>(kStepFrame)) + wire::encode(oversized) +
           std::string(1, static_cast<char>(wire::kFlagUcx)));

  std::printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}
