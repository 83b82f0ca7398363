// Frames of a request/response exchange (declared in transport/frames.h).
#include "transport/frames.h"

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/limits.h"
#include "transport/path.h"

namespace pdlink {

namespace {
constexpr size_t kIovBatch = 1024;  // iovecs per sendmsg/recvmsg
}  // namespace

Status sendResponse(Stream& s, const Status& st, Deadline deadline) {
  std::string msg = st.message().substr(0, wire::kMaxMessageBytes);
  wire::ResponseHeader h{static_cast<uint32_t>(st.code()), static_cast<uint32_t>(msg.size()), 0, s.epochTag()};
  return s.sendFrame(wire::encode(h) + msg, deadline);
}

Status sendAnswer(Stream& s, const std::string& answer, Deadline deadline) {
  const std::string head = wire::encode(wire::ResponseHeader{0, 0, answer.size(), s.epochTag()});
  if (!s.authenticated()) return s.sendFrame(head + answer, deadline);  // one write: no tags between
  PDLINK_RETURN_IF_ERROR(s.sendFrame(head, deadline));
  return s.sendFrame(answer, deadline);
}

Status readAnswer(Stream& s, uint64_t len, uint64_t max, Deadline deadline, std::string* out, const char* what) {
  PDLINK_RETURN_IF_ERROR(s.readBounded(len, max, deadline, out, what));
  return s.checkFrame(deadline);
}

// Reads a response header, and its message text when the status is an error.
Status readResponse(Stream& s, Deadline deadline, wire::ResponseHeader* h, Status* remote) {
  uint8_t buf[wire::kResponseHeaderBytes];
  PDLINK_RETURN_IF_ERROR(s.recvAll(buf, sizeof(buf), deadline));
  PDLINK_RETURN_IF_ERROR(wire::decode(buf, sizeof(buf), h));
  if (h->status == 0 && h->message_len != 0) return Status(Code::kLinkFailed, "malformed response (text on success)");
  std::string msg;
  PDLINK_RETURN_IF_ERROR(s.readBounded(h->message_len, wire::kMaxMessageBytes, deadline, &msg, "response text"));
  if (h->status != 0 && h->payload_len != 0) return Status(Code::kLinkFailed, "malformed response (payload on error)");
  PDLINK_RETURN_IF_ERROR(s.checkFrame(deadline));
  *remote = h->status == 0 ? Status::OK() : Status(static_cast<Code>(h->status), msg);
  return Status::OK();
}

namespace {

// Tensor-major, batching iovecs so that thousands of small blocks cost a few syscalls, not one each.
Status moveBytes(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                 uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> iov) {
  for (uint32_t t : tensors) {
    for (const wire::Run& r : runs) {
      iov.push_back({reinterpret_cast<void*>(addrs[t] + base + r.offset), static_cast<size_t>(r.length)});
      if (iov.size() >= kIovBatch) {
        PDLINK_RETURN_IF_ERROR(sending ? s.sendv(iov, deadline) : s.recvv(iov, deadline));
        iov.clear();
      }
    }
  }
  if (!iov.empty()) PDLINK_RETURN_IF_ERROR(sending ? s.sendv(iov, deadline) : s.recvv(iov, deadline));
  return Status::OK();
}

// Chunk by chunk (limits::kPayloadChunkBytes of the payload each), through one host buffer: with
// payload integrity each chunk is a frame of its own, and a received chunk is staged and checked
// before any of it lands in memory; pieces in a device backend's DEVICE memory (`device`, may be
// null: none) pass through the buffer, copied by `backend` (the host cannot address them). Sender
// and receiver cut the same chunks, whatever the pieces are.
//
// Copies a staged chunk whose tag checked out to its destination pieces (the application's cache
// memory). Its own function so that .ci/tsan.supp can name this copy, ordered against the
// application's use of the cache through the peer process, without hiding the rest of the path.
Status landCheckedChunk(const std::vector<iovec>& pieces, const std::vector<uint8_t>& on_device, Backend* backend,
                        const uint8_t* staged) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    const iovec& v = pieces[i];
    if (on_device[i]) {
      PDLINK_RETURN_IF_ERROR(backend->copy(v.iov_base, Placement::kDevice, staged, Placement::kHost, v.iov_len));
    } else {
      std::memcpy(v.iov_base, staged, v.iov_len);
    }
    staged += v.iov_len;
  }
  return Status::OK();
}

Status moveChunked(Stream& s, bool sending, const std::vector<Segment>& pieces, const std::vector<uint8_t>* device,
                   Backend* backend, Deadline deadline) {
  uint64_t total = 0;
  for (const Segment& g : pieces) total += g.length;  // checked sums: no overflow
  // One chunk, or the whole payload when smaller; not zeroed.
  std::unique_ptr<uint8_t[]> staging(
      new uint8_t[std::min<uint64_t>(std::max<uint64_t>(total, 1), limits::kPayloadChunkBytes)]);
  std::vector<iovec> chunk;        // the destination (or source) pieces of the current chunk
  std::vector<uint8_t> on_device;  // per piece of the chunk
  size_t filled = 0;
  auto flush = [&]() -> Status {
    if (filled == 0) return Status::OK();
    Status st;
    if (sending) {
      st = s.payloadIntegrity() ? s.sendFrame(chunk, deadline) : s.sendv(chunk, deadline);
    } else {
      st = s.recvAll(staging.get(), filled, deadline);
      if (st.ok()) st = s.checkFrame(deadline);
      if (st.ok()) st = landCheckedChunk(chunk, on_device, backend, staging.get());  // only a chunk that checked out
    }
    chunk.clear();
    on_device.clear();
    filled = 0;
    return st;
  };
  for (size_t i = 0; i < pieces.size(); ++i) {
    const bool dev = device != nullptr && (*device)[i];
    auto* p = reinterpret_cast<uint8_t*>(pieces[i].addr);
    uint64_t left = pieces[i].length;
    while (left > 0) {
      const size_t take = static_cast<size_t>(std::min<uint64_t>(left, limits::kPayloadChunkBytes - filled));
      if (sending && dev) {  // the bytes leave from the buffer, at their place in the chunk
        PDLINK_RETURN_IF_ERROR(backend->copy(staging.get() + filled, Placement::kHost, p, Placement::kDevice, take));
        chunk.push_back({staging.get() + filled, take});
      } else {
        chunk.push_back({p, take});
      }
      on_device.push_back(dev);
      filled += take;
      p += take;
      left -= take;
      if (filled == limits::kPayloadChunkBytes) PDLINK_RETURN_IF_ERROR(flush());
    }
  }
  return flush();
}

}  // namespace

Status movePayload(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> frame) {
  if (!frame.empty() && s.authenticated()) {  // its own frame; without tags it rides in the payload's first write
    PDLINK_RETURN_IF_ERROR(s.sendFrame(frame, deadline));
    frame.clear();
  }
  s.payload(true);
  Status st = s.payloadIntegrity()
                  ? moveChunked(s, sending, pieces(addrs, tensors, base, runs), nullptr, nullptr, deadline)
                  : moveBytes(s, sending, addrs, tensors, base, runs, deadline, std::move(frame));
  s.payload(false);
  return st;
}

Status moveStagedPayload(Stream& s, bool sending, const std::vector<Segment>& pieces,
                         const std::vector<uint8_t>& device, Backend& backend, Deadline deadline,
                         std::vector<iovec> frame) {
  if (!frame.empty()) PDLINK_RETURN_IF_ERROR(s.sendFrame(frame, deadline));
  s.payload(true);
  Status st = moveChunked(s, sending, pieces, &device, &backend, deadline);
  s.payload(false);
  return st;
}

Status discardPayload(Stream& s, uint64_t len, Deadline deadline) {
  s.payload(true);
  Status st;
  // In the chunks it was sent in (each checked, with payload integrity), or all at once.
  const uint64_t step = s.payloadIntegrity() ? limits::kPayloadChunkBytes : std::max<uint64_t>(len, 1);
  for (uint64_t left = len; st.ok() && left > 0; left -= std::min(left, step)) {
    st = s.discard(std::min(left, step), deadline);
    if (st.ok()) st = s.checkFrame(deadline);
  }
  s.payload(false);
  return st;
}

}  // namespace pdlink
