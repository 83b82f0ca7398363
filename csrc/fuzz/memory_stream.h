// MemoryStream: a Stream (transport/stream.h) over bytes in memory, so that the real serving loop
// (Engine::serveStream) runs without sockets in the fuzzer. Reads come from `input` and end with
// kLinkFailed ("closed by peer") when it is used up; writes are kept, up to `keep` bytes (the rest is
// counted and dropped, so a large read answer costs no memory). Single-threaded.
#pragma once

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "transport/stream.h"

namespace pdlink::fuzz {

class MemoryStream final : public Stream {
 public:
  MemoryStream(const uint8_t* data, size_t size, size_t keep = size_t{1} << 20) : in_(data), size_(size), keep_(keep) {}

  Status sendv(std::vector<iovec>& iov, Deadline) override {
    for (iovec& v : iov) {
      const size_t room = keep_ - std::min(keep_, out_.size());
      out_.append(static_cast<const char*>(v.iov_base), std::min(room, v.iov_len));
      sent_ += v.iov_len;
      v.iov_len = 0;
    }
    return Status::OK();
  }

  Status recvv(std::vector<iovec>& iov, Deadline) override {
    for (iovec& v : iov) {
      if (v.iov_len > size_ - pos_) {
        pos_ = size_;
        return Status(Code::kLinkFailed, "receive: connection to " + peer_ + " closed by peer");
      }
      std::memcpy(v.iov_base, in_ + pos_, v.iov_len);
      pos_ += v.iov_len;
      v.iov_len = 0;
    }
    return Status::OK();
  }

  Status waitReadable(Deadline) override {
    return pos_ < size_ ? Status::OK() : Status(Code::kLinkFailed, "receive: connection closed by peer");
  }

  const std::string& peer() const override { return peer_; }

  const std::string& output() const { return out_; }
  size_t sent() const { return sent_; }

 private:
  const uint8_t* in_;
  size_t size_;
  size_t pos_ = 0;
  size_t keep_;
  std::string out_;
  size_t sent_ = 0;
  std::string peer_ = "fuzz input";
};

}  // namespace pdlink::fuzz
