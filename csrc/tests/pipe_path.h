// A data path of the test build only (path_test registers it: registerTestPath), to show that a
// path is its own files plus one registration line (transport/path_table.h): its requests are the
// link's, its bytes move through a socketpair of this process instead of the link's stream.
//
// It applies to a link whose peer is another engine of this process under Transport::kAuto (the
// only place both ends of one socketpair are), ahead of every built-in path. Requests carry
// wire::kFlagTestPath. kRead: the server answers OK, then sends the payload into the socketpair.
// kWrite: the server answers OK (accepted), the requester sends the payload into the socketpair,
// then the server answers again (stored). A refusal is an answer like any other: nothing moves.
// Every engine of the process shares the one socketpair: one link at a time uses this path (as in
// path_test); a transfer that fails mid-payload breaks its link and leaves the socketpair out of
// step, so the process cannot use the path again.
#pragma once

#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink::testing {

class PipePath : public DataPath {
 public:
  PipePath();
  const PathCaps& caps() const override { return caps_; }
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  PathCaps caps_;
};

class PipeServer : public PathServer {
 public:
  Status serve(ServeCall& call) override;
};

// The path's table entry (registerTestPath(pipeEntry)).
PathEntry pipeEntry();

}  // namespace pdlink::testing
