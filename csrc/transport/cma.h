// Cross-memory attach (process_vm_readv / process_vm_writev): the same-host data path.
//
// Two processes on one host that may ptrace each other (same user, and Yama permitting) can copy
// memory between their address spaces in one system call per 1024 ranges, with no socket and no
// intermediate copy. The engine uses it only after a handshake showed both ends on the same host
// and a probe read succeeded; otherwise it streams over TCP.
// Threading: stateless; safe from any thread.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <vector>

#include "core/status.h"

namespace pdlink::cma {

// Copies between local[i] and remote[i] (equal lengths pairwise) in the process `pid`; `write`
// selects the direction (false: remote -> local). kLinkFailed if the peer is gone, kParamInvalid
// if an address is not mapped there (EFAULT), with errno's text in the message.
Status copy(pid_t pid, bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote);

// Reads one 8-byte word of `pid` at `addr`; the link-time check that direct access is permitted.
Result<uint64_t> readWord(pid_t pid, uint64_t addr);

// Allows any process of this user to attach (prctl PR_SET_PTRACER_ANY). Needed where Yama's
// ptrace_scope is 1, which otherwise limits attaching to ancestors; a no-op elsewhere.
void allowPeers();

}  // namespace pdlink::cma
