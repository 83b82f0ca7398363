// The cma path: direct reads and writes of a same-host peer's memory (transport/cma/cma.h), on a
// link the kernel proved to join two processes of this host (Link::sameHost) and whose probe read
// succeeded. The peer checks and pins every access as usual and answers with its addresses
// (DirectAnswer); a read of a blocks cache whose layout this side has cached, or of registered
// memory by address while this side has the peer's table of it, needs no round trip at all: one
// ordered process_vm_readv of the data and then the peer's registry generation.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>

#include <functional>
#include <optional>

#include "transport/cma/cma.h"
#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink {

class CmaPath : public DataPath {
 public:
  // `process`: the peer's process (cma::Process, Link::peerProcess); `published_addr`: where its
  // registry publishes its generation (Registry::Published), in that process.
  CmaPath(std::shared_ptr<const cma::Process> process, uint64_t published_addr);
  const PathCaps& caps() const override { return caps_; }
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;
  // How the copies reach the peer: "process_vm" or "proc_mem" (cma::Process::Mode).
  std::vector<std::string> lanes() const override {
    return process_ ? std::vector<std::string>{process_->modeName()} : std::vector<std::string>{};
  }

 private:
  // kDescribe of `p`'s target: the answer's payload (at most `max_bytes`). Not OK with the link
  // intact: the peer refused, and the checked round trip gives its own answer.
  Status describe(Link& link, const std::string& body, uint8_t flags, uint64_t max_bytes, Deadline deadline,
                  const char* what, std::string* payload);
  // The ordered read of the fast paths: the runs `local[i]` <- `remote[i]`, then the peer's
  // generation word; true when it equals `generation` (nothing changed since the describe). False
  // leaves `local` untouched, except for a read over kBounceBytes whose copy raced a change.
  // The role fence around it (wire v7's epoch fence where the server never sees the read): the
  // peer's role word (Registry::Published, `epoch << 1 | pending`, kRoleWordOffset past the
  // generation) is read before the copy and after it (after the generation): a pending switch fails
  // the read with kRoleSwitching, and for a prepared transfer (Link::EpochTags::send != 0) an epoch
  // whose tag is not the transfer's with kStaleEpoch; before the copy that changes nothing, after it
  // only the destination of a read over kBounceBytes. A read that passes reports the epoch's tag
  // as the peer's answer would (EpochTags::seen): a prepared transfer's first post binds it.
  Result<bool> readChecked(Link& link, std::vector<iovec>& local, std::vector<iovec>& remote, uint64_t generation);
  Status roleFence(Link& link, bool after);
  static constexpr uint64_t kRoleWordOffset = 8;
  // The steps of transfer(). `local`: this side's ranges, tensor by tensor and run by run; `lv`,
  // `rv`: the caller's (thread-local) scratch; `body`: p.remote encoded, lazily (encodedBody).
  static const std::string& encodedBody(const TransferPlan& p, std::string& body);
  // The fast path of a read of a blocks cache (by its cached layout, fetched once by kDescribe), or
  // of registered memory by address (by the cached table): the transfer's result, or nullopt when
  // it goes the checked way (no usable layout, or it changed twice).
  std::optional<Status> readCachedBlocks(Link& link, const TransferPlan& p, const std::vector<iovec>& local,
                                         std::vector<iovec>& lv, std::vector<iovec>& rv, std::string& body,
                                         Deadline deadline, const char* what);
  std::optional<Status> readCachedRaw(Link& link, const TransferPlan& p, const std::vector<iovec>& local,
                                      std::vector<iovec>& lv, std::vector<iovec>& rv, std::string& body,
                                      Deadline deadline, const char* what);
  // The checked round trip: the peer resolves and pins the ranges and answers with their
  // addresses (readDirectAnswer checks its size and lengths); the copy then reads the peer's pin
  // epoch word again (copyPinned), and finishPinned unpins.
  Status checkedAccess(Link& link, TransferPlan& p, bool is_push, std::vector<iovec>& local, std::string& body,
                       Deadline deadline, const char* what);
  static Status readDirectAnswer(Link& link, const wire::ResponseHeader& rh, const std::vector<iovec>& local,
                                 Deadline deadline, wire::DirectAnswer* answer);
  Status copyPinned(bool is_push, std::vector<iovec>& local, std::vector<iovec>& remote_iov,
                    const wire::DirectAnswer& answer);
  static constexpr size_t kBounceBytes = 256 * 1024;  // reads up to this size are staged (one memcpy)

  PathCaps caps_;
  const std::shared_ptr<const cma::Process> process_;
  const uint64_t published_addr_;
  std::map<uint64_t, wire::CacheDescriptor> descriptors_;  // model_id -> the peer's layout; out mutex
  std::optional<wire::RawTable> raw_table_;                // the peer's registered memory; out mutex
};

// Answers a checked direct access with the addresses of exactly the resolved ranges and the serving
// link's pin epoch word (ServeCall::pin_epoch), and keeps them pinned until the peer's next frame.
class CmaServer : public PathServer {
 public:
  Status serve(ServeCall& call) override;
};

// The cma path's part in making a link, which the link manager calls as it makes one.
// The grant: keeps this process readable by the same-host peer `peer_pid` (cma::Grant) for as long
// as the result lives (the link holds it until it breaks, Link::holdUntilBroken); null where there
// is nothing to grant (pid 0: no same-host proof; a peer inside this process).
std::shared_ptr<void> cmaGrant(pid_t peer_pid);
// The probe: whether this side's requests copy the peer's memory directly, only for a peer the
// kernel identified (peer_pid != 0) on the AF_UNIX `channel`, held as a cma::Process, after a probe
// read of its published words (at `published_addr`, in the process the kernel named, never a claimed
// one); *process is then set. `allowed`: the engine's transport may be cma (auto or forced);
// `forced`: it is forced to cma, and a link where it is not possible fails (kLinkFailed, or the
// probe's failure).
Status cmaProbe(const Socket& channel, pid_t peer_pid, uid_t peer_uid, uint64_t published_addr, bool allowed,
                bool forced, std::shared_ptr<const cma::Process>* process);

// cma's table entry: applies where the handshake proved direct access (LinkFacts::direct), served
// always (admitAccess lets a direct request through on a same-host link only).
PathEntry cmaEntry();

}  // namespace pdlink
