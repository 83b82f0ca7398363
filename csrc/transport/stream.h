// Stream: a reliable byte stream with deadline-bounded, scatter-gather I/O. A link's channels are
// Sockets (transport/socket.h); the serving loop and the frame helpers read and write through this
// interface only, so they run unchanged over an in-memory stream (the fuzzer's, csrc/fuzz).
//
// Threading: one thread may send while another receives; two concurrent senders (or receivers)
// must be serialised by the caller.
// Errors: a deadline that passes gives kTimeout; a closed or failing stream gives kLinkFailed.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"

namespace pdlink {

class Stream {
 public:
  virtual ~Stream() = default;
  // The iovec array is consumed (modified) as bytes move.
  virtual Status sendv(std::vector<iovec>& iov, Deadline deadline) = 0;
  virtual Status recvv(std::vector<iovec>& iov, Deadline deadline) = 0;
  // Blocks until data (or EOF) is readable.
  virtual Status waitReadable(Deadline deadline) = 0;
  // Who is at the other end, for messages.
  virtual const std::string& peer() const = 0;

  // Frames (an authenticated link's channels are AuthStreams: transport/auth_stream.h; on any
  // other stream the frame calls only send, or do nothing). A frame is the bytes sent between two
  // seals. sendFrame: sends these bytes and ends the frame (with its tag, in the same write).
  // sealFrame: ends the frame made of the bytes sent since the last seal. checkFrame: the bytes
  // received since the last check are one frame: read its tag and check it (kLinkFailed when it
  // does not match); call it before acting on any of them. payload(true): the frames that follow
  // are a transfer's payload (tensor bytes), which has a tag only with payload integrity (without
  // it, seal and check do nothing); payload(false) ends it. Called at frame boundaries only.
  virtual Status sendFrame(std::vector<iovec>& iov, Deadline deadline) { return sendv(iov, deadline); }
  virtual Status sealFrame(Deadline deadline) {
    (void)deadline;
    return Status::OK();
  }
  virtual Status checkFrame(Deadline deadline) {
    (void)deadline;
    return Status::OK();
  }
  virtual void payload(bool on) { (void)on; }
  virtual bool authenticated() const { return false; }
  virtual bool payloadIntegrity() const { return false; }

  Status sendFrame(const std::string& frame, Deadline deadline);
  Status sendAll(const void* data, size_t len, Deadline deadline);
  Status recvAll(void* data, size_t len, Deadline deadline);
  // Reads and discards exactly `len` bytes (to resynchronise after rejecting a payload).
  Status discard(uint64_t len, Deadline deadline);
  // Reads exactly `len` bytes into `out` (replacing it), refusing `len` > `max` before reading
  // anything. The buffer grows in limits::kReadChunkBytes steps as bytes arrive, so a peer that
  // announces a large body and sends nothing costs no memory.
  Status readBounded(uint64_t len, uint64_t max, Deadline deadline, std::string* out, const char* what);

  // The wire's epoch tag (a u32 since v8): what every response sent on this stream carries (sendResponse,
  // sendAnswer), read from the serving engine's word (EngineState::epoch_tag); 0 while unset.
  void setEpochWord(const std::atomic<uint32_t>* word) { epoch_word_ = word; }
  uint32_t epochTag() const { return epoch_word_ ? epoch_word_->load(std::memory_order_acquire) : 0; }

 private:
  const std::atomic<uint32_t>* epoch_word_ = nullptr;  // set by the serving thread before it serves
};

}  // namespace pdlink
