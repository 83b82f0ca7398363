// The test build's socketpair path (pipe_path.h).
#include "pipe_path.h"

#include <sys/socket.h>

#include <cstdlib>

#include "transport/frames.h"
#include "transport/socket.h"

namespace pdlink::testing {

namespace {

// The process's socketpair: the requester's end and the server's end, made on first use and kept
// for the life of the process (engines may serve until exit).
struct Pair {
  Socket requester, server;
};

Pair& pair() {
  static Pair* p = [] {
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) std::abort();  // a test without its path
    return new Pair{Socket(fds[0], "pipe"), Socket(fds[1], "pipe")};
  }();
  return *p;
}

}  // namespace

PipePath::PipePath() {
  caps_.name = "pipe";
  caps_.request_flags = wire::kFlagTestPath;
}

Status PipePath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  if (!p.local_device_runs.empty()) return Status(Code::kFeatureNotEnabled, "the pipe path moves host memory only");
  const std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  PDLINK_RETURN_IF_ERROR(requestAccess(link, body, is_push, wire::kFlagTestPath, deadline, what, &rh));
  Status st = movePayload(pair().requester, is_push, p.local_addrs, p.local_tensors, 0, p.local_runs, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  if (is_push) return awaitResponse(link, deadline, what, &rh);
  commitPull(link, p, body, deadline);
  return Status::OK();
}

Status PipeServer::serve(ServeCall& call) {
  const bool is_write = call.header.op == wire::Op::kWrite;
  PDLINK_RETURN_IF_ERROR(sendResponse(call.stream, Status::OK(), call.deadline));
  PDLINK_RETURN_IF_ERROR(
      movePayload(pair().server, !is_write, call.addrs, call.tensors, call.base, call.runs, call.deadline));
  return is_write ? sendResponse(call.stream, Status::OK(), call.deadline) : Status::OK();
}

PathEntry pipeEntry() {
  PathEntry e;
  e.caps = PipePath().caps();
  e.server = std::make_unique<PipeServer>();
  e.applies = [](const LinkFacts& f) { return f.in_process && f.auto_transport; };
  e.make = [](const LinkFacts&) -> std::unique_ptr<DataPath> { return std::make_unique<PipePath>(); };
  return e;
}

}  // namespace pdlink::testing
