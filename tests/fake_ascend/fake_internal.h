// Internal interface between the two fake libraries: the fake libhccl.so needs the fake ACL's
// per-thread device, its device-memory map and its streams, none of which the real ACL API exposes.
// The fake libascendcl.so exports a single extra symbol, fake_ascend_hooks(), returning this table,
// so the export list stays "the vendor table + the control API + one hook getter". Both libraries
// are always built together by tests/fake_ascend/build.py with the same compiler, so C++ types
// (std::function) may cross this boundary.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "backends/ascend/ascend_min.h"

namespace fake {

// Where a range of device memory lives: the RW view the fakes copy through, and the backing memfd
// (so the one-sided HCCL path can hand the memory to a peer process).
struct DevRange {
  char* shadow;        // RW alias of the first byte of the range
  int memfd;           // file backing the range
  uint64_t file_off;   // offset of the first byte in memfd
  uint64_t file_size;  // size of memfd
  int device;
};

struct Hooks {
  int version;
  // Counts a call of `fn` and applies fault injection: returns the injected rc, or 0.
  int (*enter)(const char* fn);
  // The calling thread's current device, or -1 after recording ACL_ERROR_RT_CONTEXT_NULL as the
  // thread's error text (aclGetRecentErrMsg) on behalf of `fn`.
  int (*current_device)(const char* fn);
  // Records "fn: text" as the calling thread's error text; returns rc.
  int (*fail)(const char* fn, int rc, const char* text);
  // True if [p, p+n) lies inside one live allocation or one IPC-imported region.
  bool (*lookup)(const void* p, size_t n, DevRange* out);
  // Queues `task` on `stream` (nullptr: the current device's default stream) and returns an ACL
  // code. The task returns 0 or an HcclResult; a non-zero result makes the next synchronize of the
  // stream return ACL_ERROR_RT_INTERNAL_ERROR with `what` in the error text.
  int (*enqueue)(aclrtStream stream, std::function<int()> task, const char* what);
};

constexpr int kHooksVersion = 1;

// Environment knobs: seconds as a double ("0.5"), sizes with an optional K/M/G suffix.
inline double env_double(const char* name, double dflt) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  double d = strtod(v, &end);
  return (end != v && d >= 0) ? d : dflt;
}

inline uint64_t env_size(const char* name, uint64_t dflt) {
  const char* v = getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  unsigned long long n = strtoull(v, &end, 0);
  if (end == v) return dflt;
  switch (*end) {
    case 'k':
    case 'K':
      n <<= 10;
      break;
    case 'm':
    case 'M':
      n <<= 20;
      break;
    case 'g':
    case 'G':
      n <<= 30;
      break;
    default:
      break;
  }
  return n;
}

// ---- Unix-socket helpers (both libraries talk over abstract Unix sockets: no files to clean up,
// and the name disappears with the process).

inline socklen_t abstract_addr(const std::string& name, sockaddr_un* a) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t n = name.size() < sizeof(a->sun_path) - 1 ? name.size() : sizeof(a->sun_path) - 1;
  memcpy(a->sun_path + 1, name.data(), n);  // sun_path[0] == 0: abstract namespace
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

constexpr int kMaxFds = 16;

// Waits for `events` on fd; 0 when ready (or hung up), ETIMEDOUT, or an errno.
inline int wait_fd(int fd, short events, int timeout_ms) {
  pollfd pf{fd, events, 0};
  int r = poll(&pf, 1, timeout_ms);
  if (r > 0) return 0;
  return r == 0 ? ETIMEDOUT : (errno == EINTR ? 0 : errno);
}

// Sends exactly n bytes, waiting at most timeout_ms (< 0: forever) for each bit of progress, so a
// stuck peer costs a bounded wait. `fds` (SCM_RIGHTS) ride on the first byte. Non-blocking per
// call (MSG_DONTWAIT), so it works on blocking sockets too. Returns 0, ETIMEDOUT or an errno.
inline int sock_send(int fd, const void* buf, size_t n, int timeout_ms, const int* fds = nullptr, int nfds = 0) {
  const char* p = static_cast<const char*>(buf);
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFds)];
  while (n > 0) {
    iovec iov{const_cast<char*>(p), n};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (nfds > 0 && nfds <= kMaxFds) {
      memset(ctl, 0, sizeof ctl);
      m.msg_control = ctl;
      m.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      cmsghdr* c = CMSG_FIRSTHDR(&m);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
      nfds = 0;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    if (int e = wait_fd(fd, POLLOUT, timeout_ms)) return e;
  }
  return 0;
}

// Receives exactly n bytes (same waiting rules); EOF before that is EPIPE. Up to max_fds received
// descriptors are stored in fds (count in *nfds); any beyond that are closed.
inline int sock_recv(int fd, void* buf, size_t n, int timeout_ms, int* fds = nullptr, int max_fds = 0,
                     int* nfds = nullptr) {
  char* p = static_cast<char*>(buf);
  alignas(cmsghdr) char ctl[CMSG_SPACE(sizeof(int) * kMaxFds)];
  if (nfds) *nfds = 0;
  while (n > 0) {
    iovec iov{p, n};
    msghdr m{};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    if (max_fds > 0) {
      m.msg_control = ctl;
      m.msg_controllen = sizeof ctl;
    }
    ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (r > 0) {
      for (cmsghdr* c = max_fds > 0 ? CMSG_FIRSTHDR(&m) : nullptr; c; c = CMSG_NXTHDR(&m, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int k = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int i = 0; i < k; ++i) {
          int got;
          memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
          if (*nfds < max_fds)
            fds[(*nfds)++] = got;
          else
            close(got);
        }
      }
      p += r;
      n -= static_cast<size_t>(r);
      continue;
    }
    if (r == 0) return EPIPE;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno;
    if (int e = wait_fd(fd, POLLIN, timeout_ms)) return e;
  }
  return 0;
}

}  // namespace fake

extern "C" __attribute__((visibility("default"))) const fake::Hooks* fake_ascend_hooks(void);
