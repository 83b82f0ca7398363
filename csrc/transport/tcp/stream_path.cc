// The stream path (transport/tcp/stream_path.h).
#include "transport/tcp/stream_path.h"

#include "transport/frames.h"

namespace pdlink {

StreamPath::StreamPath(bool unix_socket, Backend* backend) : backend_(backend) {
  caps_.name = unix_socket ? "unix" : "tcp";
  caps_.request_flags = 0;
  caps_.cross_host = !unix_socket;
}

namespace {

// The payload of one side: its pieces straight from (or into) memory, or staged when some lie in
// DEVICE memory (`device`, per run: then tensors is {0} and the runs absolute).
Status move(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
            uint64_t base, const std::vector<wire::Run>& runs, const std::vector<uint8_t>& device, Backend* backend,
            Deadline deadline, std::vector<iovec> frame = {}) {
  if (device.empty()) return movePayload(s, sending, addrs, tensors, base, runs, deadline, std::move(frame));
  return moveStagedPayload(s, sending, pieces(addrs, tensors, base, runs), device, *backend, deadline,
                           std::move(frame));
}

}  // namespace

Status StreamPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  if (!p.local_device_runs.empty() && backend_ == nullptr) {
    return Status(Code::kFeatureNotEnabled, "this stream path cannot stage DEVICE memory");
  }
  Stream& s = link.out();
  std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st;
  if (is_push) {  // the payload follows the request in the same stream
    wire::RequestHeader h{wire::Op::kWrite, static_cast<uint32_t>(body.size()), p.payload};
    std::string head = wire::encode(h);
    std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
    st = move(s, true, p.local_addrs, p.local_tensors, 0, p.local_runs, p.local_device_runs, backend_, deadline,
              std::move(iov));
    if (!st.ok()) return failTransfer(link, st, what);
    return awaitResponse(link, deadline, what, &rh);
  }
  st = request(link, wire::RequestHeader{wire::Op::kRead, static_cast<uint32_t>(body.size()), 0}, body, deadline, what,
               &rh);
  if (!st.ok()) return st;
  if (rh.payload_len != p.payload) {
    return failTransfer(link,
                        Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) + " bytes, expected " +
                                                      std::to_string(p.payload)),
                        what);
  }
  st = move(s, false, p.local_addrs, p.local_tensors, 0, p.local_runs, p.local_device_runs, backend_, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  commitPull(link, p, body, deadline);
  return Status::OK();
}

Status StreamServer::serve(ServeCall& call) {
  if (call.header.op == wire::Op::kWrite) {
    PDLINK_RETURN_IF_ERROR(move(call.stream, false, call.addrs, call.tensors, call.base, call.runs, call.device_runs,
                                &backend_, call.deadline));
    return sendResponse(call.stream, Status::OK(), call.deadline);
  }
  std::string head = wire::encode(wire::ResponseHeader{0, 0, call.payload});
  return move(call.stream, true, call.addrs, call.tensors, call.base, call.runs, call.device_runs, &backend_,
              call.deadline, {{head.data(), head.size()}});
}

PathEntry streamEntry(Backend& backend) {
  PathEntry e;
  e.caps = StreamPath(false).caps();
  e.server = std::make_unique<StreamServer>(backend);
  e.applies = [](const LinkFacts&) { return true; };
  e.make = [](const LinkFacts& f) -> std::unique_ptr<DataPath> { return std::make_unique<StreamPath>(f.unix_socket); };
  return e;
}

}  // namespace pdlink
