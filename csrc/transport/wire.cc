#include "transport/wire.h"

#include <cstring>

#include "core/seeded_bug.h"

namespace pdlink::wire {
namespace {

class Writer {
 public:
  template <class T>
  void put(T v) {
    char buf[sizeof(T)];
    std::memcpy(buf, &v, sizeof(T));  // hosts are little-endian (x86-64, aarch64)
    out_.append(buf, sizeof(T));
  }
  void bytes(const std::string& s) { out_.append(s); }
  std::string take() { return std::move(out_); }

 private:
  std::string out_;
};

// Bounds-checked reader: every get() fails cleanly past the end instead of reading beyond it.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  template <class T>
  bool get(T* v) {
    if (n_ - pos_ < sizeof(T)) return false;
    std::memcpy(v, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  size_t left() const { return n_ - pos_; }
  // The next `k` bytes (k <= left(), checked by the caller), skipped.
  const char* take(size_t k) {
    const char* at = reinterpret_cast<const char*>(p_) + pos_;
    pos_ += k;
    return at;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

}  // namespace

Status malformed(const char* what) {
  return Status(Code::kLinkFailed, std::string("malformed ") + what + " frame from peer");
}

bool HostHint::sameHost(const HostHint& o) const {
  static const uint8_t zero[16] = {0};
  return std::memcmp(boot_id, zero, 16) != 0 && std::memcmp(boot_id, o.boot_id, 16) == 0 && pid_ns == o.pid_ns &&
         pid_ns != 0;
}

std::string encode(const Hello& h) {
  Writer w;
  w.put(kHelloMagic);
  w.put(h.version);
  w.put(static_cast<uint8_t>(h.channel));
  w.put(h.flags);
  w.put(h.cluster_id);
  w.put(h.expected_peer);
  w.bytes(std::string(reinterpret_cast<const char*>(h.nonce.data()), h.nonce.size()));
  w.bytes(std::string(reinterpret_cast<const char*>(h.challenge), kChallengeBytes));
  return w.take();
}

Status decodeRest(const uint8_t* p, size_t n, Hello* out) {
  if (n < kHelloBytes - kHelloPrefixBytes) return malformed("hello");
  std::memcpy(out->nonce.data() + 8, p, 8);
  std::memcpy(out->challenge, p + 8, kChallengeBytes);
  return Status::OK();
}

Status decodePrefix(const uint8_t* p, size_t n, Hello* out) {
  Reader r(p, n);
  uint32_t magic = 0;
  uint8_t channel = 0;
  if (!r.get(&magic) || magic != kHelloMagic) {
    return Status(Code::kLinkFailed, "peer is not a pdlink endpoint (bad hello magic)");
  }
  if (!r.get(&out->version) || !r.get(&channel) || !r.get(&out->flags) || !r.get(&out->cluster_id) ||
      !r.get(&out->expected_peer) || n < kHelloPrefixBytes) {
    return malformed("hello");
  }
  std::memcpy(out->nonce.data(), p + kHelloPrefixBytes - 8, 8);
  if (channel > static_cast<uint8_t>(Channel::kLane)) return malformed("hello");
  out->channel = static_cast<Channel>(channel);
  return Status::OK();
}

std::string encode(const HelloAck& a) {
  Writer w;
  w.put(kAckMagic);
  w.put(a.version);
  w.put(a.status);
  w.put(a.cluster_id);
  w.put(static_cast<uint32_t>(a.message.size()));
  w.bytes(std::string(reinterpret_cast<const char*>(a.challenge), kChallengeBytes));
  w.bytes(std::string(reinterpret_cast<const char*>(a.proof), kProofBytes));
  w.bytes(a.message);
  return w.take();
}

Status decodeFixed(const uint8_t* p, size_t n, HelloAck* out, uint32_t* message_len) {
  Reader r(p, n);
  uint32_t magic = 0;
  if (!r.get(&magic) || magic != kAckMagic) {
    return Status(Code::kLinkFailed, "peer is not a pdlink endpoint (bad hello-ack magic)");
  }
  if (!r.get(&out->version) || !r.get(&out->status) || !r.get(&out->cluster_id) || !r.get(message_len)) {
    return malformed("hello-ack");
  }
  if (*message_len > kMaxMessageBytes || n < kHelloAckFixedBytes || !isKnownCode(out->status)) {
    return malformed("hello-ack");
  }
  std::memcpy(out->challenge, p + 22, kChallengeBytes);
  std::memcpy(out->proof, p + 22 + kChallengeBytes, kProofBytes);
  return Status::OK();
}

std::string encode(const ClientAuth& a) {
  Writer w;
  w.bytes(std::string(reinterpret_cast<const char*>(a.proof), kProofBytes));
  w.bytes(std::string(reinterpret_cast<const char*>(a.hint.boot_id), 16));
  w.put(a.hint.pid_ns);
  w.put(a.gen_addr);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, ClientAuth* out) {
  if (n < kClientAuthBytes) return malformed("client-auth");
  std::memcpy(out->proof, p, kProofBytes);
  std::memcpy(out->hint.boot_id, p + kProofBytes, 16);
  Reader r(p + kProofBytes + 16, n - kProofBytes - 16);
  r.get(&out->hint.pid_ns);
  r.get(&out->gen_addr);
  return Status::OK();
}

std::string encode(const RequestHeader& h) {
  Writer w;
  w.put(kRequestMagic);
  w.put(static_cast<uint8_t>(h.op));
  w.put(static_cast<uint8_t>(h.flags | (h.split ? kMarkSplit : 0)));
  w.put(uint16_t{0});
  w.put(h.epoch_tag);
  w.put(h.body_len);
  w.put(h.payload_len);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, RequestHeader* out) {
  Reader r(p, n);
  uint32_t magic = 0;
  uint8_t op = 0;
  uint16_t zero = 0;
  if (!r.get(&magic) || magic != kRequestMagic) return malformed("request");
  if (!r.get(&op) || !r.get(&out->flags) || !r.get(&zero) || !r.get(&out->epoch_tag) || !r.get(&out->body_len) ||
      !r.get(&out->payload_len) || zero != 0) {
    return malformed("request");
  }
  // The split mark only on a plain read or a kRelease (the stream path's split pulls).
  out->split = (out->flags & kMarkSplit) != 0;
  out->flags &= static_cast<uint8_t>(~kMarkSplit);
  if (out->split &&
      (out->flags != 0 || (op != static_cast<uint8_t>(Op::kRead) && op != static_cast<uint8_t>(Op::kRelease)))) {
    return malformed("request");
  }
  if (!isOp(op) || (out->flags & ~kKnownFlags) ||
      ((out->flags & kFlagOneSided) && out->flags != (kFlagDevice | kFlagOneSided)) ||
      ((out->flags & kFlagUcx) && out->flags != kFlagUcx) ||
      ((out->flags & kFlagTestPath) && out->flags != kFlagTestPath) || out->body_len > kMaxBodyBytes) {
    return malformed("request");
  }
  out->op = static_cast<Op>(op);
  return Status::OK();
}

bool isOp(uint8_t op) {
  // 8 and 10: v4's device-channel and ucx-connect frames, replaced by kPathConnect.
  return op >= 1 && op <= kMaxOp && op != 8 && op != 10;
}

std::string pathConnectBody(uint8_t path, const std::string& setup) {
  std::string body(1, static_cast<char>(path));
  static_assert(kPathConnectHeaderBytes == 1, "the header is the path's id");
  return body + setup;
}

std::string encode(const UcxHello& h) {
  Writer w;
  w.put(h.token);
  w.put(h.chunk_bytes);
  w.bytes(h.address);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, UcxHello* out) {
  Reader r(p, n);
  if (!r.get(&out->token) || !r.get(&out->chunk_bytes) || n - 12 == 0 || n - 12 > kMaxUcxAddressBytes) {
    return malformed("ucx hello");
  }
  const uint32_t c = out->chunk_bytes;
  if (c != 0 && (c < kMinUcxChunkBytes || c > kMaxUcxChunkBytes || (c & (c - 1)) != 0)) {
    return malformed("ucx hello (message size)");
  }
  out->address.assign(reinterpret_cast<const char*>(p) + 12, n - 12);
  return Status::OK();
}

std::string encode(const ResponseHeader& h) {
  Writer w;
  w.put(kResponseMagic);
  w.put(h.status);
  w.put(h.message_len);
  w.put(h.payload_len);
  w.put(h.epoch_tag);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, ResponseHeader* out) {
  Reader r(p, n);
  uint32_t magic = 0;
  if (!r.get(&magic) || magic != kResponseMagic) return malformed("response");
  if (!r.get(&out->status) || !r.get(&out->message_len) || !r.get(&out->payload_len) || !r.get(&out->epoch_tag)) {
    return malformed("response");
  }
  if (out->message_len > kMaxMessageBytes || !isKnownCode(out->status)) return malformed("response");
  return Status::OK();
}

std::string Target::describe() const {
  switch (kind) {
    case TargetKind::kRequestKey:
      return "request key (req_id=" + std::to_string(req_id) + ", model_id=" + std::to_string(model_id) + ")";
    case TargetKind::kPrefixKey:
      return "prefix key (prefix_id=" + std::to_string(prefix_id) + ", model_id=" + std::to_string(model_id) + ")";
    case TargetKind::kIdIndex:
      return "cache (cache_id=" + std::to_string(cache_id) + ", batch_index=" + std::to_string(batch_index) + ")";
    case TargetKind::kBlocks:
      return "blocks cache (model_id=" + std::to_string(model_id) + ")";
    case TargetKind::kRaw:
      return "registered memory";
    case TargetKind::kOffer:
      return "offer " + std::to_string(req_id) + " of blocks cache (model_id=" + std::to_string(model_id) + ")";
  }
  return "unknown target";
}

Result<uint64_t> TransferBody::payloadBytes() const {
  uint64_t per_tensor = 0;
  for (const Run& r : runs) {
    if (__builtin_add_overflow(per_tensor, r.length, &per_tensor)) {
      return Status(Code::kParamInvalid, "transfer size overflows");
    }
  }
  uint64_t total = 0;
  if (__builtin_mul_overflow(per_tensor, static_cast<uint64_t>(tensors.size()), &total)) {
    return Status(Code::kParamInvalid, "transfer size overflows");
  }
  return total;
}

std::vector<Row> rowsOf(const std::vector<Run>& runs) {
  std::vector<Row> rows;
  size_t i = 0;
  while (i < runs.size()) {
    Row row{runs[i].offset, runs[i].length, runs[i].length, 1};
    size_t j = i + 1;
    if (j < runs.size() && runs[j].length == row.length && runs[j].offset >= row.offset) {
      row.stride = runs[j].offset - row.offset;
      while (j < runs.size() && runs[j].length == row.length && runs[j].offset >= runs[j - 1].offset &&
             runs[j].offset - runs[j - 1].offset == row.stride) {
        ++j;
      }
      row.count = j - i;
      if (row.count == 1) row.stride = row.length;
    }
    rows.push_back(row);
    i += row.count;
  }
  return rows;
}

std::string encode(const TransferBody& b) {
  Writer w;
  w.put(static_cast<uint8_t>(b.target.kind));
  w.put(b.target.model_id);
  w.put(b.target.req_id);
  w.put(b.target.prefix_id);
  w.put(b.target.cache_id);
  w.put(b.target.batch_index);
  w.put(b.block_size);
  w.put(static_cast<uint32_t>(b.tensors.size()));
  for (uint32_t t : b.tensors) w.put(t);
  const std::vector<Row> rows = rowsOf(b.runs);
  if (2 * rows.size() < b.runs.size()) {  // a row is twice a pair's bytes
    w.put(static_cast<uint32_t>(rows.size()) | kRowsMark);
    for (const Row& r : rows) {
      w.put(r.offset);
      w.put(r.length);
      w.put(r.stride);
      w.put(r.count);
    }
    return w.take();
  }
  w.put(static_cast<uint32_t>(b.runs.size()));
  for (const Run& r : b.runs) {
    w.put(r.offset);
    w.put(r.length);
  }
  return w.take();
}

Status decode(const uint8_t* p, size_t n, TransferBody* out) {
  Reader r(p, n);
  uint8_t kind = 0;
  uint32_t count = 0;
  Target& t = out->target;
  if (!r.get(&kind) || !r.get(&t.model_id) || !r.get(&t.req_id) || !r.get(&t.prefix_id) || !r.get(&t.cache_id) ||
      !r.get(&t.batch_index) || !r.get(&out->block_size)) {
    return malformed("transfer");
  }
  if (kind < 1 || kind > 6) return malformed("transfer");
  t.kind = static_cast<TargetKind>(kind);
  // Counts are bounded by the bytes that are there and by the limits before anything is allocated.
  if (!r.get(&count)) return malformed("transfer");
  if constexpr (seeded::bug(seeded::kReserve)) out->tensors.reserve(count);  // fuzz demonstration only
  if (count > r.left() / sizeof(uint32_t) || count > limits::kMaxRequestTensors) {
    return malformed("transfer");
  }
  const uint64_t tensors = count;
  out->tensors.resize(count);
  for (uint32_t i = 0; i < count; ++i) r.get(&out->tensors[i]);
  if (!r.get(&count)) return malformed("transfer");
  out->rows.clear();
  if (count & kRowsMark) {
    // Rows: each checked, and the runs they hold counted against the limit, before any is expanded.
    count &= ~kRowsMark;
    if (count > r.left() / (4 * sizeof(uint64_t)) || count == 0) return malformed("transfer");
    out->rows.resize(count);
    uint64_t pieces = 0;
    for (Row& row : out->rows) {
      uint64_t span = 0, end = 0;
      r.get(&row.offset);
      r.get(&row.length);
      r.get(&row.stride);
      r.get(&row.count);
      if (row.count == 0 || row.count > limits::kMaxRequestPieces ||
          __builtin_mul_overflow(row.stride, row.count - 1, &span) || __builtin_add_overflow(span, row.length, &span) ||
          __builtin_add_overflow(row.offset, span, &end)) {
        return malformed("transfer");
      }
      pieces += row.count;  // at most kMaxRequestPieces per row and kMaxBodyBytes / 32 rows: no overflow
      if (pieces > limits::kMaxRequestPieces || tensors * pieces > limits::kMaxRequestPieces) {
        return malformed("transfer");
      }
    }
    out->runs.clear();
    out->runs.reserve(pieces);
    for (const Row& row : out->rows) {
      for (uint64_t k = 0; k < row.count; ++k) out->runs.push_back(Run{row.offset + k * row.stride, row.length});
    }
  } else {
    if (count > r.left() / (2 * sizeof(uint64_t)) || tensors * count > limits::kMaxRequestPieces) {
      return malformed("transfer");
    }
    out->runs.resize(count);
    for (uint32_t i = 0; i < count; ++i) {
      r.get(&out->runs[i].offset);
      r.get(&out->runs[i].length);
    }
  }
  if (r.left() != 0) return malformed("transfer");
  return Status::OK();
}

std::string encode(const AuthResult& r) {
  Writer w;
  w.put(kAuthMagic);
  w.put(r.status);
  w.put(static_cast<uint32_t>(r.message.size()));
  w.put(static_cast<uint16_t>(r.redirect.size()));
  w.put(r.gen_addr);
  w.put(r.flags);
  w.bytes(std::string(reinterpret_cast<const char*>(r.tag), sizeof(r.tag)));
  w.bytes(r.message);
  w.bytes(r.redirect);
  return w.take();
}

Status decodeFixed(const uint8_t* p, size_t n, AuthResult* out, uint32_t* message_len, uint16_t* redirect_len) {
  Reader r(p, n);
  uint32_t magic = 0;
  if (!r.get(&magic) || magic != kAuthMagic || !r.get(&out->status) || !r.get(message_len) || !r.get(redirect_len) ||
      !r.get(&out->gen_addr) || !r.get(&out->flags) || *message_len > kMaxMessageBytes ||
      *redirect_len > limits::kUnixNameBytes || !isKnownCode(out->status) ||
      (out->flags & ~kAuthPayloadIntegrity) != 0 || n < kAuthResultFixedBytes) {
    return malformed("auth-result");
  }
  std::memcpy(out->tag, p + kAuthResultFixedBytes - sizeof(out->tag), sizeof(out->tag));
  return Status::OK();
}

std::string encode(const CacheDescriptor& d) {
  Writer w;
  w.put(d.generation);
  w.put(d.tensor_size);
  w.put(d.stride);
  w.put(static_cast<uint32_t>(d.addrs.size()));
  for (uint64_t a : d.addrs) w.put(a);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, CacheDescriptor* out) {
  Reader r(p, n);
  uint32_t count = 0;
  if (!r.get(&out->generation) || !r.get(&out->tensor_size) || !r.get(&out->stride) || !r.get(&count) ||
      count != r.left() / sizeof(uint64_t) || r.left() % sizeof(uint64_t) != 0 || count == 0 ||
      count > limits::kMaxRequestTensors || out->stride == 0 || out->stride > out->tensor_size) {
    return malformed("descriptor");
  }
  out->addrs.resize(count);
  for (uint32_t i = 0; i < count; ++i) r.get(&out->addrs[i]);
  return Status::OK();
}

std::string encode(const RawTable& t) {
  Writer w;
  w.put(t.generation);
  w.put(static_cast<uint32_t>(t.ranges.size()));
  for (const Run& r : t.ranges) {
    w.put(r.offset);
    w.put(r.length);
  }
  return w.take();
}

Status decode(const uint8_t* p, size_t n, RawTable* out) {
  Reader r(p, n);
  uint32_t count = 0;
  if (!r.get(&out->generation) || !r.get(&count) || r.left() % 16 != 0 || count != r.left() / 16 ||
      count > limits::kMaxRequestTensors) {
    return malformed("raw memory table");
  }
  out->ranges.resize(count);
  for (uint32_t i = 0; i < count; ++i) {
    Run& run = out->ranges[i];
    uint64_t end = 0;
    r.get(&run.offset);
    r.get(&run.length);
    if (run.length == 0 || __builtin_add_overflow(run.offset, run.length, &end) ||
        (i > 0 && run.offset < out->ranges[i - 1].offset)) {
      return malformed("raw memory table");
    }
  }
  return Status::OK();
}

std::string encode(const DirectAnswer& a) {
  Writer w;
  w.put(a.pin_epoch);
  w.put(a.epoch_addr);
  for (size_t i = 0; i < a.addrs.size(); ++i) {
    w.put(a.addrs[i]);
    w.put(a.lengths[i]);
  }
  return w.take();
}

uint64_t directAnswerBytes(uint64_t pieces) { return 16 + 16 * pieces; }

Status decode(const uint8_t* p, size_t n, uint64_t expected_pieces, DirectAnswer* out) {
  if (expected_pieces > limits::kMaxRequestPieces || n != directAnswerBytes(expected_pieces)) {
    return malformed("direct-access answer");
  }
  Reader r(p, n);
  r.get(&out->pin_epoch);
  r.get(&out->epoch_addr);
  out->addrs.resize(expected_pieces);
  out->lengths.resize(expected_pieces);
  for (uint64_t i = 0; i < expected_pieces; ++i) {
    r.get(&out->addrs[i]);
    r.get(&out->lengths[i]);
  }
  return Status::OK();
}

Status decodeAddresses(const uint8_t* p, size_t n, uint64_t expected, std::vector<uint64_t>* out) {
  if (expected > limits::kMaxRequestPieces || n != 8 * expected) return malformed("address-list answer");
  Reader r(p, n);
  out->resize(expected);
  for (uint64_t i = 0; i < expected; ++i) r.get(&(*out)[i]);
  return Status::OK();
}

std::string encode(const IpcAnswer& a) {
  Writer w;
  for (size_t i = 0; i < a.keys.size(); ++i) {
    std::string padded = a.keys[i].substr(0, limits::kIpcKeyBytes);
    padded.resize(limits::kIpcKeyBytes, '\0');
    w.bytes(padded);
    w.put(a.spans[i]);
  }
  return w.take();
}

Status decode(const uint8_t* p, size_t n, uint64_t expected_tensors, IpcAnswer* out) {
  if (expected_tensors > limits::kMaxRequestTensors || n != kIpcEntryBytes * expected_tensors) {
    return malformed("IPC answer");
  }
  out->keys.clear();
  out->spans.clear();
  for (uint64_t i = 0; i < expected_tensors; ++i) {
    const char* k = reinterpret_cast<const char*>(p + i * kIpcEntryBytes);
    size_t len = 0;
    while (len < limits::kIpcKeyBytes && k[len] != '\0') ++len;
    if (len == 0) return malformed("IPC answer");
    uint64_t span = 0;
    std::memcpy(&span, p + i * kIpcEntryBytes + limits::kIpcKeyBytes, 8);
    out->keys.emplace_back(k, len);
    out->spans.push_back(span);
  }
  return Status::OK();
}

std::string encode(const NotifyBody& b) {
  Writer w;
  w.put(static_cast<uint32_t>(b.name.size()));
  w.bytes(b.name);
  w.bytes(b.message);
  return w.take();
}

Status decode(const uint8_t* p, size_t n, NotifyBody* out) {
  Reader r(p, n);
  uint32_t name_len = 0;
  if (!r.get(&name_len) || name_len > limits::kMaxNotifyNameBytes || name_len > r.left() ||
      r.left() - name_len > limits::kMaxNotifyMessageBytes) {
    return malformed("notification");
  }
  const char* c = reinterpret_cast<const char*>(p) + 4;
  out->name.assign(c, name_len);
  out->message.assign(c + name_len, n - 4 - name_len);
  return Status::OK();
}

bool isUtf8(const char* p, size_t n) {
  const auto* s = reinterpret_cast<const unsigned char*>(p);
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range (the rest are 0x80..0xBF)
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong below
      if (c == 0xED) hi = 0x9F;  // surrogates above
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong below
      if (c == 0xF4) hi = 0x8F;  // past U+10FFFF above
    } else {
      return false;  // a continuation byte, an overlong lead (C0, C1) or F5..FF
    }
    if (n - i < len || s[i + 1] < lo || s[i + 1] > hi) return false;
    for (size_t k = 2; k < len; ++k) {
      if (s[i + k] < 0x80 || s[i + k] > 0xBF) return false;
    }
    i += len;
  }
  return true;
}

std::string encode(const HandoffBody& b) {
  Writer w;
  w.put(static_cast<uint8_t>(b.kind));
  if (b.kind == HandoffBody::kAbort) {
    w.put(static_cast<uint16_t>(b.request_id.size()));
    w.bytes(b.request_id);
    w.put(static_cast<uint16_t>(b.reason.size()));
    w.bytes(b.reason);
  } else {
    w.put(static_cast<uint32_t>(b.offers.size()));
    for (const auto& [id, generation] : b.offers) {
      w.put(id);
      w.put(generation);
    }
  }
  return w.take();
}

Status decode(const uint8_t* p, size_t n, HandoffBody* out) {
  Reader r(p, n);
  uint8_t kind = 0;
  if (!r.get(&kind)) return malformed("handoff");
  if (kind == HandoffBody::kAbort) {
    out->kind = HandoffBody::kAbort;
    uint16_t len = 0;
    if (!r.get(&len) || len > limits::kMaxHandoffRequestIdBytes || len > r.left()) return malformed("handoff");
    out->request_id.assign(r.take(len), len);
    if (!r.get(&len) || len > limits::kMaxHandoffReasonBytes || len != r.left()) return malformed("handoff");
    out->reason.assign(r.take(len), len);
    if (!isUtf8(out->request_id.data(), out->request_id.size()) || !isUtf8(out->reason.data(), out->reason.size())) {
      return malformed("handoff");
    }
    return Status::OK();
  }
  if (kind != HandoffBody::kHold) return malformed("handoff");
  out->kind = HandoffBody::kHold;
  uint32_t count = 0;
  // Bounded by the bound and by the bytes that are there before anything is allocated.
  if (!r.get(&count) || count > limits::kMaxHoldOffers || uint64_t{count} * 16 != r.left()) {
    return malformed("handoff");
  }
  out->offers.resize(count);
  for (auto& [id, generation] : out->offers) {
    r.get(&id);
    r.get(&generation);
  }
  return Status::OK();
}

}  // namespace pdlink::wire
