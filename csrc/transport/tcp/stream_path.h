// The stream path: a transfer's bytes travel in the link's own channel, right after the request
// (push) or the response (pull), as a payload frame (sealed or checked under payload integrity).
// Works across hosts over TCP, and on one host over the AF_UNIX channels of a same-host link whose
// direct reads are not possible. Host memory only: DEVICE memory of a device backend never leaves
// through a channel (transport/device).
#pragma once

#include "transport/path.h"

namespace pdlink {

class StreamPath : public DataPath {
 public:
  // `unix_socket`: the link's channels are AF_UNIX connections (reported as "unix", else "tcp").
  explicit StreamPath(bool unix_socket);
  const PathCaps& caps() const override { return caps_; }
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  PathCaps caps_;
};

// Reads the payload of a write into the resolved ranges, or streams the resolved ranges back.
class StreamServer : public PathServer {
 public:
  Status serve(ServeCall& call) override;
};

}  // namespace pdlink
