// The stream path: a transfer's bytes travel in the link's own channel, right after the request
// (push) or the response (pull), as a payload frame (sealed or checked under payload integrity).
// Works across hosts over TCP, and on one host over the AF_UNIX channels of a same-host link whose
// direct reads are not possible. Host memory only: DEVICE memory of a device backend never leaves
// through a channel (transport/device), except that the ranges of a descriptor list (a kRaw
// request, a local_absolute plan) in DEVICE memory pass through host staging on either side
// (moveStagedPayload): how a list mixing HOST and DEVICE memory, or one between HOST and DEVICE
// memory, moves at all.
//
// Several streams (a tcp link this side dialled, EngineLimits::tcp_streams > 1): a transfer of at
// least two chunks (EngineLimits::tcp_chunk_bytes) opens the link's lanes the first time (extra TCP
// connections, transport/wire.h "LANE"; Link::openLanesOnce), then is cut into chunk requests, each
// naming a part of the transfer's ranges (admitted by the peer exactly like a whole request), spread
// over the link's channel and its lanes by work sharing, each stream keeping 2 or more requests in
// flight (more as the measured round trip grows: depthFor). Any stream's failure breaks the link and
// fails the transfer (kTimeout at the deadline, which all streams share, else kLinkFailed); a pull
// commits (releases a request key) only after every chunk arrived. Smaller transfers, transfers with
// staged DEVICE runs and links without lanes move as one request on the channel.
#pragma once

#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink {

class StreamPath : public DataPath {
 public:
  // `unix_socket`: the link's channels are AF_UNIX connections (reported as "unix", else "tcp").
  // `backend` (not owned, outlives the path): stages plans with local_device_runs; without one such
  // a plan is kFeatureNotEnabled.
  explicit StreamPath(bool unix_socket, Backend* backend = nullptr);
  const PathCaps& caps() const override { return caps_; }
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  // The split transfer over the out channel and `lanes`; kFeatureNotEnabled (nothing moved) when the
  // plan cannot be cut.
  Status transferSplit(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what,
                       const std::vector<Stream*>& lanes);
  PathCaps caps_;
  Backend* backend_;
};

// Reads the payload of a write into the resolved ranges, or streams the resolved ranges back
// (through host staging for the DEVICE runs of a kRaw request, copied by `backend`).
class StreamServer : public PathServer {
 public:
  explicit StreamServer(Backend& backend) : backend_(backend) {}
  Status serve(ServeCall& call) override;

 private:
  Backend& backend_;
};

// The stream's table entry: applies to every link (the last host path tried), served always.
PathEntry streamEntry(Backend& backend);

}  // namespace pdlink
