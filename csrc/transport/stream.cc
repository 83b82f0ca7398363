#include "transport/stream.h"

#include <algorithm>

#include "core/limits.h"

namespace pdlink {

Status Stream::sendAll(const void* data, size_t len, Deadline deadline) {
  std::vector<iovec> iov{{const_cast<void*>(data), len}};
  return sendv(iov, deadline);
}

Status Stream::sendFrame(const std::string& frame, Deadline deadline) {
  std::vector<iovec> iov{{const_cast<char*>(frame.data()), frame.size()}};
  return sendFrame(iov, deadline);
}

Status Stream::recvAll(void* data, size_t len, Deadline deadline) {
  std::vector<iovec> iov{{data, len}};
  return recvv(iov, deadline);
}

Status Stream::discard(uint64_t len, Deadline deadline) {
  char buf[64 * 1024];
  while (len > 0) {
    size_t chunk = static_cast<size_t>(std::min<uint64_t>(len, sizeof(buf)));
    PDLINK_RETURN_IF_ERROR(recvAll(buf, chunk, deadline));
    len -= chunk;
  }
  return Status::OK();
}

Status Stream::readBounded(uint64_t len, uint64_t max, Deadline deadline, std::string* out, const char* what) {
  out->clear();
  if (len > max) {
    return Status(Code::kLinkFailed, std::string(what) + " of " + std::to_string(len) + " bytes from " + peer() +
                                         " exceeds the limit of " + std::to_string(max));
  }
  while (out->size() < len) {
    const size_t have = out->size();
    const size_t step = static_cast<size_t>(std::min<uint64_t>(len - have, std::max(have, limits::kReadChunkBytes)));
    out->resize(have + step);
    PDLINK_RETURN_IF_ERROR(recvAll(out->data() + have, step, deadline));
  }
  return Status::OK();
}

}  // namespace pdlink
