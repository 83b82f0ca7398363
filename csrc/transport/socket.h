// Socket: an owned, non-blocking stream socket (TCP, or AF_UNIX for same-host links) with
// deadline-bounded, scatter-gather I/O.
//
// Ownership: a Socket owns its file descriptor and closes it on destruction. It is movable, not
// copyable.
// Threading: one thread may send while another receives on the same Socket; two concurrent senders
// (or receivers) must be serialised by the caller. shutdown() may be called from any thread at any
// time: it wakes a thread blocked in send/recv/waitReadable, which then fails with kLinkFailed.
// Errors: a deadline that passes gives kTimeout; a closed, reset or failing connection gives
// kLinkFailed. The message names the operation and the peer.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "transport/stream.h"

namespace pdlink {

// What the kernel recorded about the process at the other end of an AF_UNIX connection
// (SO_PEERCRED): for the connecting side, the process that created the listening socket; for the
// accepting side, the process that connected. `pid` is in this process's pid namespace, 0 when the
// peer's is not visible from here.
struct PeerCredentials {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
};

class Socket final : public Stream {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer = "");
  ~Socket() override;
  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Connects to ip:port (IPv4 dotted string or host name resolving to IPv4) within the deadline.
  static Result<Socket> connect(const std::string& ip, uint16_t port, Deadline deadline);
  // Connects to the AF_UNIX socket with this abstract name (no leading NUL; at most
  // limits::kUnixNameBytes). kLinkFailed when nobody listens under that name in this network
  // namespace.
  static Result<Socket> connectUnix(const std::string& name, Deadline deadline);

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& peer() const override { return peer_; }
  bool isUnix() const { return unix_; }
  // SO_PEERCRED of an AF_UNIX socket; kFailed for TCP sockets.
  Result<PeerCredentials> peerCredentials() const;
  // For a TCP connection from a loopback address (127.0.0.0/8): the uid owning the other end's
  // socket, as the kernel's socket table says (NETLINK_SOCK_DIAG, one exact lookup). kFailed for
  // other connections, or when the lookup fails.
  Result<uid_t> loopbackPeerUid() const;
  // This end as the acceptor names the other end (peer() of an accepted socket): "ip:port" of a
  // TCP socket's local address, "unix:pid <this process>" for AF_UNIX.
  std::string localEndpoint() const;

  Status sendv(std::vector<iovec>& iov, Deadline deadline) override;
  Status recvv(std::vector<iovec>& iov, Deadline deadline) override;
  // Spins first (see setReceiveSpin). kLinkFailed after shutdown().
  Status waitReadable(Deadline deadline) override;

  // Before blocking in poll(2) for incoming data, retry the receive for up to `us` microseconds.
  // A requester waiting for a short reply then avoids a sleep/wake-up cycle, which on loopback
  // costs more than the round trip itself (about 50 vs 20 us on a 2-core VM). 0 (default): never.
  void setReceiveSpin(int us) { spin_us_ = us; }

  // Wakes any blocked I/O and makes further I/O fail. Idempotent; the fd stays open until
  // destruction so that no other thread can be handed the same fd number meanwhile.
  void shutdown();

 private:
  friend class ListenSocket;
  Status waitFor(short events, Deadline deadline, const char* what);
  Status ioError(const char* what, int err) const;

  int fd_ = -1;
  int spin_us_ = 0;
  bool unix_ = false;
  std::string peer_;
};

// Listening socket bound to ip:port (port 0 picks a free port; see port()), or to an AF_UNIX
// abstract name.
class ListenSocket {
 public:
  static Result<ListenSocket> bind(const std::string& ip, uint16_t port);
  // kFailed when the name is taken (abstract names are first come, first served).
  static Result<ListenSocket> bindUnix(const std::string& name);
  ListenSocket() = default;
  ~ListenSocket();
  ListenSocket(ListenSocket&& other) noexcept;
  ListenSocket& operator=(ListenSocket&& other) noexcept;

  uint16_t port() const { return port_; }
  int fd() const { return fd_; }
  // Accepts one connection if one is pending (non-blocking); an invalid Socket if none, with
  // `*error` the errno of a failure other than "none pending" (EMFILE: out of descriptors, ...).
  Socket acceptOne(int* error);

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
  bool unix_ = false;
};

}  // namespace pdlink
