#include "transport/cma/cma.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77  // Linux 6.5
#endif

namespace pdlink::cma {
namespace {

constexpr size_t kMaxIov = 1024;                 // IOV_MAX
constexpr size_t kSplitBytes = size_t{8} << 20;  // copies at least this large use two threads
// The effective capabilities of a process ("CapEff:" of /proc/<pid>/status, "self" for this one);
// nullopt when they cannot be read.
std::optional<uint64_t> effectiveCaps(const std::string& pid) {
  std::ifstream status("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) == 0) return std::strtoull(line.c_str() + 7, nullptr, 16);
  }
  return std::nullopt;
}

// Whether the peer holds every power over other processes that this process holds: the same uid
// (real and effective, ours), and every capability of ours in its effective set. Then whatever
// process a reused pid number comes to name, the peer could attach to it itself.
bool peerAsPowerful(pid_t pid, uid_t uid) {
  if (uid != ::getuid() || uid != ::geteuid()) return false;
  auto mine = effectiveCaps("self"), theirs = effectiveCaps(std::to_string(pid));
  return mine && theirs && (*theirs & *mine) == *mine;
}

// The pid a pidfd refers to, as this namespace sees it ("Pid:" of its fdinfo): -1 once it exited.
pid_t pidOfPidfd(int pidfd) {
  std::ifstream info("/proc/self/fdinfo/" + std::to_string(pidfd));
  std::string line;
  while (std::getline(info, line)) {
    if (line.rfind("Pid:", 0) == 0) return static_cast<pid_t>(std::strtol(line.c_str() + 4, nullptr, 10));
  }
  return 0;
}

bool exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) != 0;  // readable (or an error): the process is gone
}

Status failure(Code code, pid_t pid, bool write, const std::string& why) {
  return Status(code, std::string("direct memory ") + (write ? "write to" : "read from") + " pid " +
                          std::to_string(pid) + " failed: " + why);
}

}  // namespace

Result<std::shared_ptr<Process>> Process::open(int sock_fd, pid_t pid, uid_t uid) {
  if (pid <= 0) return Status(Code::kLinkFailed, "the peer's pid is not visible in this pid namespace");
  int pidfd = -1;
  socklen_t len = sizeof(pidfd);
  if (::getsockopt(sock_fd, SOL_SOCKET, SO_PEERPIDFD, &pidfd, &len) != 0 || len != sizeof(pidfd) || pidfd < 0) {
    return Status(Code::kLinkFailed, std::string("no pidfd for the peer (SO_PEERPIDFD: ") + std::strerror(errno) +
                                         "): direct copies need one");
  }
  auto fail = [&](const std::string& why) -> Result<std::shared_ptr<Process>> {
    ::close(pidfd);
    return Status(Code::kLinkFailed, "no direct copies to pid " + std::to_string(pid) + ": " + why);
  };
  if (pidOfPidfd(pidfd) != pid) return fail("the peer's pidfd names another process, or it exited");
  const bool self = pid == ::getpid();
  if (!self && ::syscall(SYS_tgkill, ::getpid(), pid, 0) == 0) return fail("the pid is a thread of this process");
  // (The peer's status was read by number: it is the peer's if the pidfd shows it alive after.)
  if (self || (peerAsPowerful(pid, uid) && !exited(pidfd))) {
    return std::shared_ptr<Process>(new Process(pid, pidfd, -1, Mode::kVm));
  }
  int mem = ::open(("/proc/" + std::to_string(pid) + "/mem").c_str(), O_RDWR | O_CLOEXEC);
  if (mem < 0) return fail(std::string("/proc/<pid>/mem: ") + std::strerror(errno));
  // Alive after the open: the number still named the peer when the descriptor bound to it.
  if (exited(pidfd) || pidOfPidfd(pidfd) != pid) {
    ::close(mem);
    return fail("the process exited");
  }
  return std::shared_ptr<Process>(new Process(pid, pidfd, mem, Mode::kProcMem));
}

Process::~Process() {
  if (mem_fd_ >= 0) ::close(mem_fd_);
  ::close(pidfd_);
}

Status Process::alive() const {
  if (exited(pidfd_)) return Status(Code::kLinkFailed, "the peer process " + std::to_string(pid_) + " exited");
  if (mode_ == Mode::kVm && pid_ != ::getpid() && ::syscall(SYS_tgkill, ::getpid(), pid_, 0) == 0) {
    return Status(Code::kLinkFailed, "the peer's pid " + std::to_string(pid_) + " now names a thread of this process");
  }
  return Status::OK();
}

Status Process::copyRange(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote, size_t begin,
                          size_t end) const {
  if (mode_ == Mode::kProcMem) {
    // One positioned read or write per range; the descriptor reaches only the process it was
    // opened on. 0 bytes: that process's memory is gone.
    for (size_t i = begin; i < end; ++i) {
      auto* at = static_cast<uint8_t*>(local[i].iov_base);
      uint64_t addr = reinterpret_cast<uint64_t>(remote[i].iov_base);
      size_t left = local[i].iov_len;
      while (left > 0) {
        if (addr > static_cast<uint64_t>(INT64_MAX) - left)
          return failure(Code::kParamInvalid, pid_, write, "bad address");
        ssize_t got = write ? ::pwrite(mem_fd_, at, left, static_cast<off_t>(addr))
                            : ::pread(mem_fd_, at, left, static_cast<off_t>(addr));
        if (got < 0 && errno == EINTR) continue;
        if (got == 0) return failure(Code::kLinkFailed, pid_, write, "the process exited");
        if (got < 0) {
          return failure(errno == ESRCH ? Code::kLinkFailed : Code::kParamInvalid, pid_, write, std::strerror(errno));
        }
        at += got;
        addr += static_cast<uint64_t>(got);
        left -= static_cast<size_t>(got);
      }
    }
    return Status::OK();
  }
  for (size_t i = begin; i < end; i += kMaxIov) {
    size_t n = std::min(kMaxIov, end - i);
    size_t want = 0;
    for (size_t k = 0; k < n; ++k) want += local[i + k].iov_len;
    ssize_t got = write ? ::process_vm_writev(pid_, &local[i], n, &remote[i], n, 0)
                        : ::process_vm_readv(pid_, &local[i], n, &remote[i], n, 0);
    if (got == static_cast<ssize_t>(want)) continue;
    int err = got < 0 ? errno : EFAULT;  // a short copy stops at an unmapped range
    return failure((err == ESRCH || err == EPERM) ? Code::kLinkFailed : Code::kParamInvalid, pid_, write,
                   std::strerror(err));
  }
  return Status::OK();
}

Status Process::copyChecked(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote,
                            bool ordered) const {
  PDLINK_RETURN_IF_ERROR(alive());
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  Status st;
  // A large copy is split between this thread and a helper: the kernel copies page by page on
  // the calling CPU, so one thread leaves memory bandwidth unused (measured: bench/).
  if (ordered || total < kSplitBytes || local.size() < 2) {
    st = copyRange(write, local, remote, 0, local.size());
  } else {
    size_t half = 0, acc = 0;
    while (half < local.size() && acc < total / 2) acc += local[half++].iov_len;
    Status other;
    std::thread helper([&] { other = copyRange(write, local, remote, half, local.size()); });
    Status mine = copyRange(write, local, remote, 0, half);
    helper.join();
    st = mine.ok() ? other : mine;
  }
  // After the copy too: a process that exited meanwhile fails the copy and breaks the link.
  Status still = alive();
  return still.ok() ? st : still;
}

Status Process::copy(bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote) const {
  if (local.size() != remote.size()) return Status(Code::kParamInvalid, "direct copy: range lists differ");
  return copyChecked(write, local, remote);
}

Result<uint64_t> Process::readThenWord(std::vector<iovec>& local, std::vector<iovec>& remote,
                                       uint64_t word_addr) const {
  if (local.size() != remote.size()) return Status(Code::kParamInvalid, "direct copy: range lists differ");
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  if (total >= kSplitBytes) {  // may be split between two threads: the word only after both halves
    PDLINK_RETURN_IF_ERROR(copyChecked(false, local, remote));
    return readWord(word_addr);
  }
  uint64_t word = 0;
  local.push_back({&word, sizeof(word)});
  remote.push_back({reinterpret_cast<void*>(word_addr), sizeof(word)});
  // One ordered copy, so the word is read after every byte (appended, it makes one more range, which
  // copyChecked must not hand to a second thread).
  Status st = copyChecked(false, local, remote, /*ordered=*/true);
  local.pop_back();
  remote.pop_back();
  if (!st.ok()) return st;
  return word;
}

Result<uint64_t> Process::readWord(uint64_t addr) const {
  uint64_t value = 0;
  std::vector<iovec> l{{&value, sizeof(value)}}, r{{reinterpret_cast<void*>(addr), sizeof(value)}};
  Status st = copyChecked(false, l, r);
  if (!st.ok()) return st;
  return value;
}

namespace {
std::mutex& grantMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
size_t grants = 0;  // guarded by grantMutex()
}  // namespace

std::shared_ptr<Grant> Grant::acquire() {
  std::lock_guard<std::mutex> lock(grantMutex());
#ifdef PR_SET_PTRACER
  if (grants == 0) (void)::prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
  ++grants;
  return std::shared_ptr<Grant>(new Grant());
}

Grant::~Grant() {
  std::lock_guard<std::mutex> lock(grantMutex());
  if (--grants == 0) {
#ifdef PR_SET_PTRACER
    (void)::prctl(PR_SET_PTRACER, 0, 0, 0, 0);
#endif
  }
}

bool Grant::active() {
  std::lock_guard<std::mutex> lock(grantMutex());
  return grants > 0;
}

}  // namespace pdlink::cma
