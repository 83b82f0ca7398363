// Direct copies of a same-host peer's memory: the same-host data path.
//
// A Process is the process at the other end of an AF_UNIX channel, as the kernel identified it: its
// pidfd (SO_PEERPIDFD), taken when the link is made, and copies that reach exactly that process and
// no other for as long as the link lives. A pid is never taken from what a peer says.
//
// Why a pidfd is not enough. process_vm_readv/writev take a pid number, resolved at each call, and
// a pid number outlives its process: a peer that forks, passes its sockets to the child and exits
// frees its number, which the next process or thread to be created may get (a thread id counts).
// Copies to the number would then land in that process, or in this one. What holds instead:
//   kVm:      process_vm_readv/writev by number, only where a reuse gains the peer nothing: it runs
//             under this process's own uid and holds every capability this process holds (two
//             unprivileged processes of one user; two root processes with the same capabilities).
//             Whatever process the number comes to name, the peer could attach to it itself. The
//             number is also refused when it names a thread of this process, and the pidfd is
//             checked before and after each copy. Also the mode for this very process (its own
//             number cannot be reused).
//   kProcMem: any other peer (another uid, or fewer capabilities: a root engine and an
//             unprivileged peer): copies through a /proc/<pid>/mem descriptor opened once, while the
//             pidfd showed the process alive. The descriptor stays bound to that process's memory:
//             after the process exits it reads and writes nothing, whatever process gets the number.
//             It costs a kernel bounce copy: about 2x process_vm_readv for bulk copies
//             (bench/cma_ceiling.c, docs/security.md).
// A peer whose pidfd cannot be had (kernel without SO_PEERPIDFD, a pid this namespace cannot see),
// or whose memory this process may not open, gets no direct copies: the link streams.
// Threading: safe from any thread; the descriptors close when the last owner lets go.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "core/status.h"

namespace pdlink::cma {

class Process {
 public:
  enum class Mode { kVm, kProcMem };
  // The process at the other end of the AF_UNIX socket `sock_fd`, which SO_PEERCRED reported as
  // `pid` (this namespace) and `uid`. Fails (kLinkFailed, saying why) where no mode above applies or
  // the process is gone; the caller then streams.
  static Result<std::shared_ptr<Process>> open(int sock_fd, pid_t pid, uid_t uid);
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  Mode mode() const { return mode_; }
  const char* modeName() const { return mode_ == Mode::kVm ? "process_vm" : "proc_mem"; }

  // Copies between local[i] and remote[i] (equal lengths pairwise); `write` selects the direction
  // (false: remote -> local). kLinkFailed if the process is gone (break the link), kParamInvalid if
  // an address is not mapped there, with the system's text in the message.
  Status copy(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote) const;
  // Reads one 8-byte word at `addr`; at link time, the check that direct access is permitted.
  Result<uint64_t> readWord(uint64_t addr) const;
  // Reads remote[i] -> local[i], then the word at `word_addr`, strictly after every byte of the
  // runs: the word proves what held until the data was read. Errors as copy. Both lists are as
  // given on return (an entry is appended for the word and removed again).
  Result<uint64_t> readThenWord(std::vector<iovec>& local, std::vector<iovec>& remote, uint64_t word_addr) const;

 private:
  Process(pid_t pid, int pidfd, int mem_fd, Mode mode) : pid_(pid), pidfd_(pidfd), mem_fd_(mem_fd), mode_(mode) {}
  // kLinkFailed once the process exited, or (kVm) when its number names a thread of this process.
  Status alive() const;
  Status copyRange(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote, size_t begin,
                   size_t end) const;
  // `ordered`: in one thread, so the ranges are copied in their order (never split between threads).
  Status copyChecked(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote,
                     bool ordered = false) const;

  const pid_t pid_;
  const int pidfd_;
  const int mem_fd_;  // kProcMem only, else -1
  const Mode mode_;
};

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
