// The IPC path: same-host DEVICE transfers through the runtime's memory sharing
// (Backend::exportMemory / importMemory; on Ascend, aclrtIpcMem*). The peer checks the access as
// usual and exports, per tensor, the span its runs cover; this side maps the spans and copies device
// to device itself. Only on a link the kernel proved to be same-host; a peer whose runtime cannot
// share device memory refuses (kFeatureNotEnabled), and the link then uses its device channel.
#pragma once

#include <string>
#include <vector>

#include "backends/backend.h"
#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink {

class IpcPath : public DataPath {
 public:
  explicit IpcPath(Backend& backend);
  const PathCaps& caps() const override { return caps_; }
  // On refusal by the peer (no IPC there) the path removes itself from the link's device paths.
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  PathCaps caps_;
  Backend& backend_;
};

// Exports the span of every resolved tensor; the exports are closed at the peer's next frame.
class IpcServer : public PathServer {
 public:
  explicit IpcServer(Backend& backend) : backend_(backend) {}
  Status serve(ServeCall& call) override;

 private:
  Backend& backend_;
};

// The byte range of a tensor an IPC access exports: from the first run's offset to the last run's
// end (both sides compute it from the same runs).
struct IpcSpan {
  uint64_t lo = 0, length = 0;
};
IpcSpan ipcSpan(const std::vector<wire::Run>& runs);
// The requester's check of an IPC answer: every span the server states is exactly the one this side
// computes from its own request (remote_runs). kLinkFailed otherwise.
Status checkIpcAnswer(const wire::IpcAnswer& answer, const std::vector<wire::Run>& remote_runs);
// The copies of an IPC transfer, once checkIpcAnswer passed and the keys were mapped at
// `remote_bases`: run j of tensor i lies at remote_bases[i] + (remote run j's offset - span start),
// inside the mapped span by construction. Offsets come from this side's own runs only.
std::vector<DeviceCopy> ipcCopies(const std::vector<uint64_t>& local_bases, const std::vector<wire::Run>& local_runs,
                                  const std::vector<uint64_t>& remote_bases, const std::vector<wire::Run>& remote_runs,
                                  bool is_push);

// IPC's table entry: applies to a proven same-host link where the runtime shares device memory,
// served there.
PathEntry ipcEntry(Backend& backend, const BackendOffer& offer);

}  // namespace pdlink
