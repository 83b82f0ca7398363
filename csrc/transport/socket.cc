#include "transport/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/limits.h"

namespace pdlink {
namespace {

constexpr size_t kMaxIov = 1024;  // IOV_MAX on Linux

void setNoDelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Drops `n` consumed bytes from the front of an iovec array.
void advance(std::vector<iovec>& iov, size_t& first, size_t n) {
  while (n > 0 && first < iov.size()) {
    if (n >= iov[first].iov_len) {
      n -= iov[first].iov_len;
      iov[first].iov_len = 0;
      ++first;
    } else {
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + n;
      iov[first].iov_len -= n;
      n = 0;
    }
  }
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
}

Result<sockaddr_in> resolve(const std::string& ip, uint16_t port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, ip.c_str(), &addr.sin_addr) == 1) return addr;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(ip.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return Status(Code::kParamInvalid, "cannot resolve address '" + ip + "'");
  }
  addr.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  ::freeaddrinfo(res);
  return addr;
}

// An abstract AF_UNIX address: sun_path starts with a NUL, the name follows (not NUL-terminated).
Result<std::pair<sockaddr_un, socklen_t>> unixAddress(const std::string& name) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.empty() || name.size() > limits::kUnixNameBytes || name.size() + 1 > sizeof(addr.sun_path)) {
    return Status(Code::kParamInvalid, "bad unix socket name (" + std::to_string(name.size()) + " bytes)");
  }
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  return std::make_pair(addr, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size()));
}

}  // namespace

Socket::Socket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket::Socket(Socket&& other) noexcept
    : fd_(other.fd_), spin_us_(other.spin_us_), unix_(other.unix_), peer_(std::move(other.peer_)) {
  other.fd_ = -1;
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    spin_us_ = other.spin_us_;
    unix_ = other.unix_;
    peer_ = std::move(other.peer_);
    other.fd_ = -1;
  }
  return *this;
}

Result<Socket> Socket::connect(const std::string& ip, uint16_t port, Deadline deadline) {
  auto addr = resolve(ip, port);
  if (!addr.ok()) return addr.status();
  std::string peer = ip + ":" + std::to_string(port);
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status(Code::kLinkFailed, "socket() failed: " + std::string(strerror(errno)));
  Socket sock(fd, peer);
  setNoDelay(fd);
  int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr.value()), sizeof(sockaddr_in));
  if (rc != 0 && errno != EINPROGRESS) {
    return Status(Code::kLinkFailed, "connect to " + peer + " failed: " + strerror(errno));
  }
  if (rc != 0) {
    PDLINK_RETURN_IF_ERROR(sock.waitFor(POLLOUT, deadline, "connect"));
    int err = 0;
    socklen_t len = sizeof(err);
    ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return Status(Code::kLinkFailed, "connect to " + peer + " failed: " + strerror(err));
    }
  }
  return sock;
}

Result<Socket> Socket::connectUnix(const std::string& name, Deadline deadline) {
  auto addr = unixAddress(name);
  if (!addr.ok()) return addr.status();
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status(Code::kLinkFailed, "socket(AF_UNIX) failed: " + std::string(strerror(errno)));
  Socket sock(fd, "unix:@" + name.substr(0, 16));
  sock.unix_ = true;
  // A unix connect completes at once or fails; EAGAIN means the listener's backlog is full, so
  // try again until the deadline.
  for (;;) {
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr.value().first), addr.value().second) == 0) return sock;
    if (errno == EINTR) continue;
    if (errno != EAGAIN || deadline.expired()) {
      return Status(errno == EAGAIN ? Code::kTimeout : Code::kLinkFailed,
                    "connect to " + sock.peer_ + " failed: " + strerror(errno));
    }
    ::usleep(1000);
  }
}

Result<PeerCredentials> Socket::peerCredentials() const {
  if (!unix_ || fd_ < 0) return Status(Code::kFailed, "peer credentials exist only for unix sockets");
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd_, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || len != sizeof(cred)) {
    return Status(Code::kFailed, std::string("SO_PEERCRED failed: ") + strerror(errno));
  }
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

std::string Socket::localEndpoint() const {
  if (unix_) return "unix:pid " + std::to_string(::getpid());
  sockaddr_in mine{};
  socklen_t len = sizeof(mine);
  if (fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&mine), &len) != 0) return "";
  char buf[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &mine.sin_addr, buf, sizeof(buf));
  return std::string(buf) + ":" + std::to_string(ntohs(mine.sin_port));
}

Result<uid_t> Socket::loopbackPeerUid() const {
  sockaddr_in mine{}, theirs{};
  socklen_t ml = sizeof(mine), tl = sizeof(theirs);
  if (unix_ || fd_ < 0 || ::getsockname(fd_, reinterpret_cast<sockaddr*>(&mine), &ml) != 0 ||
      ::getpeername(fd_, reinterpret_cast<sockaddr*>(&theirs), &tl) != 0 || theirs.sin_family != AF_INET ||
      (ntohl(theirs.sin_addr.s_addr) >> 24) != 127) {
    return Status(Code::kFailed, "not a TCP connection from a loopback address");
  }
  int nl = ::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
  if (nl < 0) return Status(Code::kFailed, std::string("NETLINK_SOCK_DIAG: ") + strerror(errno));
  struct {
    nlmsghdr head;
    inet_diag_req_v2 req;
  } ask{};
  ask.head.nlmsg_len = sizeof(ask);
  ask.head.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  ask.head.nlmsg_flags = NLM_F_REQUEST;
  ask.req.sdiag_family = AF_INET;
  ask.req.sdiag_protocol = IPPROTO_TCP;
  ask.req.idiag_states = ~0u;
  // The other end's socket: its source is the peer's address, its destination ours.
  ask.req.id.idiag_sport = theirs.sin_port;
  ask.req.id.idiag_dport = mine.sin_port;
  ask.req.id.idiag_src[0] = theirs.sin_addr.s_addr;
  ask.req.id.idiag_dst[0] = mine.sin_addr.s_addr;
  ask.req.id.idiag_cookie[0] = INET_DIAG_NOCOOKIE;
  ask.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  alignas(nlmsghdr) char answer[1024];
  ssize_t got = -1;
  if (::sendto(nl, &ask, sizeof(ask), 0, reinterpret_cast<sockaddr*>(&kernel), sizeof(kernel)) ==
      static_cast<ssize_t>(sizeof(ask))) {
    pollfd p{nl, POLLIN, 0};
    if (::poll(&p, 1, 100) == 1) got = ::recv(nl, answer, sizeof(answer), 0);
  }
  ::close(nl);
  const auto* head = reinterpret_cast<const nlmsghdr*>(answer);
  if (got < static_cast<ssize_t>(NLMSG_LENGTH(sizeof(inet_diag_msg))) || !NLMSG_OK(head, static_cast<size_t>(got)) ||
      head->nlmsg_type != SOCK_DIAG_BY_FAMILY) {
    return Status(Code::kFailed, "the socket table has no entry for the peer's socket");
  }
  return static_cast<uid_t>(reinterpret_cast<const inet_diag_msg*>(NLMSG_DATA(head))->idiag_uid);
}

Status Socket::ioError(const char* what, int err) const {
  if (err == 0) return Status(Code::kLinkFailed, std::string(what) + ": connection to " + peer_ + " closed by peer");
  return Status(Code::kLinkFailed, std::string(what) + " with " + peer_ + " failed: " + strerror(err));
}

Status Socket::waitFor(short events, Deadline deadline, const char* what) {
  if (fd_ < 0) return Status(Code::kLinkFailed, std::string(what) + ": socket is closed");
  for (;;) {
    pollfd p{fd_, events, 0};
    int timeout = deadline.remainingMsForPoll();
    int rc = ::poll(&p, 1, timeout);
    if (rc > 0) {
      if (p.revents & POLLNVAL) return Status(Code::kLinkFailed, std::string(what) + ": socket is closed");
      return Status::OK();  // readiness, hang-up or error: the next syscall reports which
    }
    if (rc == 0) {
      return Status(Code::kTimeout, std::string(what) + " with " + peer_ + " timed out");
    }
    if (errno != EINTR) return ioError(what, errno);
  }
}

Status Socket::waitReadable(Deadline deadline) {
  if (spin_us_ > 0) {  // see setReceiveSpin(): a busy peer's next frame usually follows at once
    auto until = Deadline::Clock::now() + std::chrono::microseconds(spin_us_);
    do {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 0) > 0) return Status::OK();
    } while (Deadline::Clock::now() < until);
  }
  return waitFor(POLLIN, deadline, "receive");
}

Status Socket::sendv(std::vector<iovec>& iov, Deadline deadline) {
  size_t first = 0;
  advance(iov, first, 0);
  while (first < iov.size()) {
    // Checked on every step, not only when blocked: a slow but steady transfer must also end.
    if (deadline.expired()) return Status(Code::kTimeout, "send to " + peer_ + " timed out");
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min(kMaxIov, iov.size() - first);
    ssize_t n = ::sendmsg(fd_, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      advance(iov, first, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      PDLINK_RETURN_IF_ERROR(waitFor(POLLOUT, deadline, "send"));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return ioError("send", n < 0 ? errno : 0);
  }
  return Status::OK();
}

Status Socket::recvv(std::vector<iovec>& iov, Deadline deadline) {
  size_t first = 0;
  Deadline::Clock::time_point spin_start{};  // when the current run of empty receives began
  advance(iov, first, 0);
  while (first < iov.size()) {
    if (deadline.expired()) return Status(Code::kTimeout, "receive from " + peer_ + " timed out");
    msghdr msg{};
    msg.msg_iov = &iov[first];
    msg.msg_iovlen = std::min(kMaxIov, iov.size() - first);
    ssize_t n = ::recvmsg(fd_, &msg, MSG_DONTWAIT);
    if (n > 0) {
      advance(iov, first, static_cast<size_t>(n));
      spin_start = Deadline::Clock::time_point{};
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      auto now = Deadline::Clock::now();
      if (spin_us_ > 0 && spin_start == Deadline::Clock::time_point{}) spin_start = now;
      if (spin_us_ > 0 && now - spin_start < std::chrono::microseconds(spin_us_)) continue;
      PDLINK_RETURN_IF_ERROR(waitFor(POLLIN, deadline, "receive"));
      spin_start = Deadline::Clock::time_point{};
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return ioError("receive", n < 0 ? errno : 0);
  }
  return Status::OK();
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Result<ListenSocket> ListenSocket::bind(const std::string& ip, uint16_t port) {
  auto addr = resolve(ip, port);
  if (!addr.ok()) return addr.status();
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status(Code::kFailed, Scope::kEngine, "socket() failed: " + std::string(strerror(errno)));
  ListenSocket ls;
  ls.fd_ = fd;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  std::string where = ip + ":" + std::to_string(port);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr.value()), sizeof(sockaddr_in)) != 0) {
    return Status(Code::kParamInvalid, "cannot listen on " + where + ": " + strerror(errno));
  }
  if (::listen(fd, 128) != 0) {
    return Status(Code::kFailed, "listen on " + where + " failed: " + strerror(errno));
  }
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  ls.port_ = ntohs(bound.sin_port);
  return ls;
}

Result<ListenSocket> ListenSocket::bindUnix(const std::string& name) {
  auto addr = unixAddress(name);
  if (!addr.ok()) return addr.status();
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return Status(Code::kFailed, Scope::kEngine, "socket(AF_UNIX) failed: " + std::string(strerror(errno)));
  ListenSocket ls;
  ls.fd_ = fd;
  ls.unix_ = true;
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr.value().first), addr.value().second) != 0) {
    return Status(Code::kFailed, "cannot bind unix socket @" + name + ": " + strerror(errno));
  }
  if (::listen(fd, 128) != 0)
    return Status(Code::kFailed, "listen on unix socket failed: " + std::string(strerror(errno)));
  return ls;
}

ListenSocket::~ListenSocket() {
  if (fd_ >= 0) ::close(fd_);
}

ListenSocket::ListenSocket(ListenSocket&& other) noexcept : fd_(other.fd_), port_(other.port_), unix_(other.unix_) {
  other.fd_ = -1;
}

ListenSocket& ListenSocket::operator=(ListenSocket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    port_ = other.port_;
    unix_ = other.unix_;
    other.fd_ = -1;
  }
  return *this;
}

Socket ListenSocket::acceptOne(int* error) {
  *error = 0;
  if (unix_) {
    int fd = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) *error = errno;
      return Socket();
    }
    Socket s(fd, "unix");
    s.unix_ = true;
    if (auto cred = s.peerCredentials(); cred.ok()) s.peer_ = "unix:pid " + std::to_string(cred.value().pid);
    return s;
  }
  sockaddr_in addr{};
  socklen_t len = sizeof(addr);
  int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) *error = errno;
    return Socket();
  }
  setNoDelay(fd);
  char buf[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &addr.sin_addr, buf, sizeof(buf));
  return Socket(fd, std::string(buf) + ":" + std::to_string(ntohs(addr.sin_port)));
}

}  // namespace pdlink
