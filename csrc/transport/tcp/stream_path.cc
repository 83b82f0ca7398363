// The stream path (transport/tcp/stream_path.h).
#include "transport/tcp/stream_path.h"

#include "transport/frames.h"

namespace pdlink {

StreamPath::StreamPath(bool unix_socket) {
  caps_.name = unix_socket ? "unix" : "tcp";
  caps_.request_flags = 0;
  caps_.cross_host = !unix_socket;
}

Status StreamPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  Stream& s = link.out();
  std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st;
  if (is_push) {  // the payload follows the request in the same stream
    wire::RequestHeader h{wire::Op::kWrite, static_cast<uint32_t>(body.size()), p.payload};
    std::string head = wire::encode(h);
    std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
    st = movePayload(s, true, p.local_addrs, p.local_tensors, 0, p.local_runs, deadline, std::move(iov));
    if (!st.ok()) return failTransfer(link, st, what);
    return awaitResponse(link, deadline, what, &rh);
  }
  st = request(link, wire::RequestHeader{wire::Op::kRead, static_cast<uint32_t>(body.size()), 0}, body, deadline,
               what, &rh);
  if (!st.ok()) return st;
  if (rh.payload_len != p.payload) {
    return failTransfer(link, Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) +
                                                            " bytes, expected " + std::to_string(p.payload)),
                        what);
  }
  st = movePayload(s, false, p.local_addrs, p.local_tensors, 0, p.local_runs, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  commitPull(link, p, body, deadline);
  return Status::OK();
}

Status StreamServer::serve(ServeCall& call) {
  if (call.header.op == wire::Op::kWrite) {
    PDLINK_RETURN_IF_ERROR(
        movePayload(call.stream, false, call.addrs, call.tensors, call.base, call.runs, call.deadline));
    return sendResponse(call.stream, Status::OK(), call.deadline);
  }
  std::string head = wire::encode(wire::ResponseHeader{0, 0, call.payload});
  return movePayload(call.stream, true, call.addrs, call.tensors, call.base, call.runs, call.deadline,
                     {{head.data(), head.size()}});
}

}  // namespace pdlink
