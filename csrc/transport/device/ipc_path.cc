// The IPC path (transport/device/ipc_path.h).
#include "transport/device/ipc_path.h"

#include <algorithm>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "transport/frames.h"

namespace pdlink {

IpcPath::IpcPath(Backend& backend) : backend_(backend) {
  caps_.name = "ipc";
  caps_.request_flags = wire::kFlagDevice | wire::kFlagDirect;
  caps_.one_sided = true;
  caps_.device_memory = true;
}

Status IpcPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  const std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st = requestAccess(link, body, is_push, wire::kFlagDevice | wire::kFlagDirect, deadline, what, &rh);
  if (st.code() == Code::kFeatureNotEnabled && !link.broken()) {  // no IPC there: the device channel from now on
    PDLINK_LOG(kInfo, "IPC with " << clusterName(link.peer()) << " unavailable (" << st.message() << "); using HCCL");
    link.dropDevicePath(this);
  }
  if (!st.ok()) return st;  // refused, or the link failed
  const size_t nt = p.remote.tensors.size();
  std::string payload;
  wire::IpcAnswer answer;
  if (rh.payload_len != nt * wire::kIpcEntryBytes) {
    st = Status(Code::kLinkFailed, "peer answered an IPC description of the wrong size");
  } else {
    st = readAnswer(link.out(), rh.payload_len, rh.payload_len, deadline, &payload, "IPC answer");
    if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), nt, &answer);
  }
  if (st.ok()) st = checkIpcAnswer(answer, p.remote.runs);
  if (!st.ok()) return failTransfer(link, st, what);

  std::vector<std::string> imported;
  std::vector<uint64_t> local_bases, remote_bases;
  Status copied;
  for (size_t i = 0; i < nt; ++i) {
    auto base = backend_.importMemory(answer.keys[i]);
    if (!base.ok()) {
      copied = base.status();
      break;
    }
    imported.push_back(answer.keys[i]);
    remote_bases.push_back(base.value());
    local_bases.push_back(p.local_addrs[p.local_tensors[i]]);
  }
  std::vector<DeviceCopy> copies;
  if (copied.ok()) copies = ipcCopies(local_bases, p.local_runs, remote_bases, p.remote.runs, is_push);
  if (copied.ok()) copied = backend_.copyDevice(copies, deadline);
  for (const std::string& key : imported) backend_.closeImport(key);
  // Unpin on the peer (and close its exports); for a completed read by request key this is also
  // the release of the key.
  finishPinned(link, p, copied.ok(), is_push, body, deadline);
  if (!copied.ok()) {
    if (copied.code() == Code::kTimeout) return failTransfer(link, copied, what);
    // Not kFeatureNotEnabled: the peer agreed, so this is a failure, not a reason to try the next path.
    return Status(copied.code() == Code::kFeatureNotEnabled ? Code::kFailed : copied.code(),
                  std::string(what) + " " + clusterName(link.peer()) + " over IPC: " + copied.message());
  }
  return Status::OK();
}

Status IpcServer::serve(ServeCall& call) {
  // One export per tensor, spanning its runs [lo, hi): the requester checks the span against its
  // own request and places its runs inside it itself.
  call.pin = true;
  const IpcSpan span = ipcSpan(call.runs);
  wire::IpcAnswer answer;
  for (uint32_t t : call.tensors) {
    auto key = backend_.exportMemory(call.addrs[t] + call.base + span.lo, span.length);
    if (key.ok() && (key.value().empty() || key.value().size() > limits::kIpcKeyBytes ||
                     key.value().find('\0') != std::string::npos)) {
      key = Status(Code::kFailed, "IPC key of an unexpected form");
    }
    // (what was exported so far is closed at the peer's next frame)
    if (!key.ok()) return sendResponse(call.stream, key.status(), call.deadline);
    call.exported.push_back(key.value());
    answer.keys.push_back(key.value());
    answer.spans.push_back(span.length);
  }
  return sendAnswer(call.stream, wire::encode(answer), call.deadline);
}

IpcSpan ipcSpan(const std::vector<wire::Run>& runs) {
  uint64_t lo = UINT64_MAX, hi = 0;
  for (const wire::Run& run : runs) {
    lo = std::min(lo, run.offset);
    hi = std::max(hi, run.offset + run.length);  // runs were checked: no overflow
  }
  return runs.empty() ? IpcSpan{0, 0} : IpcSpan{lo, hi - lo};
}

Status checkIpcAnswer(const wire::IpcAnswer& answer, const std::vector<wire::Run>& remote_runs) {
  if constexpr (seeded::bug(seeded::kOffset)) return Status::OK();  // fuzz demonstration only
  const IpcSpan span = ipcSpan(remote_runs);
  for (uint64_t stated : answer.spans) {
    if (stated != span.length) return Status(Code::kLinkFailed, "peer exported an IPC span of the wrong size");
  }
  return Status::OK();
}

std::vector<DeviceCopy> ipcCopies(const std::vector<uint64_t>& local_bases, const std::vector<wire::Run>& local_runs,
                                  const std::vector<uint64_t>& remote_bases, const std::vector<wire::Run>& remote_runs,
                                  bool is_push) {
  const IpcSpan span = ipcSpan(remote_runs);
  std::vector<DeviceCopy> copies;
  copies.reserve(local_bases.size() * local_runs.size());
  for (size_t i = 0; i < local_bases.size(); ++i) {
    for (size_t j = 0; j < local_runs.size(); ++j) {
      const uint64_t local = local_bases[i] + local_runs[j].offset;
      const uint64_t remote = remote_bases[i] + (remote_runs[j].offset - span.lo);
      copies.push_back(is_push ? DeviceCopy{remote, local, local_runs[j].length}
                               : DeviceCopy{local, remote, local_runs[j].length});
    }
  }
  return copies;
}

PathEntry ipcEntry(Backend& backend, const BackendOffer& offer) {
  PathEntry e;
  e.shared = std::make_unique<IpcPath>(backend);
  e.caps = e.shared->caps();
  if (offer.ipc) e.server = std::make_unique<IpcServer>(backend);
  e.applies = [](const LinkFacts& f) { return f.offer.ipc && f.same_host; };
  return e;
}

}  // namespace pdlink
