// Cross-memory attach (process_vm_readv / process_vm_writev): the same-host data path.
//
// Two processes on one host that may ptrace each other (same user, and Yama permitting) can copy
// memory between their address spaces in one system call per 1024 ranges, with no socket and no
// intermediate copy. The engine uses it only on a link whose channels are AF_UNIX connections to a
// process the kernel identified (transport/socket.h, PeerCredentials), after a probe read of that
// process succeeded; otherwise it streams. A pid is never taken from what a peer says.
// Threading: safe from any thread.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"

namespace pdlink::cma {

// Copies between local[i] and remote[i] (equal lengths pairwise) in the process `pid`; `write`
// selects the direction (false: remote -> local). kLinkFailed if the peer is gone, kParamInvalid
// if an address is not mapped there (EFAULT), with errno's text in the message.
Status copy(pid_t pid, bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote);

// Reads one 8-byte word of `pid` at `addr`; the link-time check that direct access is permitted.
Result<uint64_t> readWord(pid_t pid, uint64_t addr);

// Reads remote[i] -> local[i], then the 8-byte word of `pid` at `word_addr`, strictly after every
// byte of the runs (in the same ordered process_vm_readv, or, where copy would split the runs
// between threads, a readWord after both finished): the word proves what held until the data was
// read. Errors as copy. Both lists are as given on return (an entry is appended for the word and
// removed again).
Result<uint64_t> readThenWord(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote, uint64_t word_addr);

// Permission for same-host peers to copy this process's memory. Where Yama's ptrace_scope is 1,
// only ancestors may attach; a peer's process_vm_readv/writev of us needs prctl(PR_SET_PTRACER,
// PR_SET_PTRACER_ANY), which lets every process of this user attach. Yama keeps one ptracer per
// process, so per-peer grants cannot serve two peers: the permission is process-wide, held while at
// least one Grant lives (one per proven same-host link to another process) and withdrawn when the
// last one goes. Never taken on an engine whose transport is forced to tcp.
class Grant {
 public:
  static std::shared_ptr<Grant> acquire();
  ~Grant();
  Grant(const Grant&) = delete;
  Grant& operator=(const Grant&) = delete;
  // Whether the process-wide permission is in force now (for tests and `links()`).
  static bool active();

 private:
  Grant() = default;
};

}  // namespace pdlink::cma
