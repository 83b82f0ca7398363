// Socket: an owned, non-blocking TCP socket with deadline-bounded, scatter-gather I/O.
//
// Ownership: a Socket owns its file descriptor and closes it on destruction. It is movable, not
// copyable.
// Threading: one thread may send while another receives on the same Socket; two concurrent senders
// (or receivers) must be serialised by the caller. shutdown() may be called from any thread at any
// time: it wakes a thread blocked in send/recv/waitReadable, which then fails with kLinkFailed.
// Errors: a deadline that passes gives kTimeout; a closed, reset or failing connection gives
// kLinkFailed. The message names the operation and the peer.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"

namespace pdlink {

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd, std::string peer = "");
  ~Socket();
  Socket(Socket&& other) noexcept;
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  // Connects to ip:port (IPv4 dotted string or host name resolving to IPv4) within the deadline.
  static Result<Socket> connect(const std::string& ip, uint16_t port, Deadline deadline);

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  const std::string& peer() const { return peer_; }

  Status sendAll(const void* data, size_t len, Deadline deadline);
  Status recvAll(void* data, size_t len, Deadline deadline);
  // Scatter-gather variants: the iovec array is consumed (modified) as bytes move.
  Status sendv(std::vector<iovec>& iov, Deadline deadline);
  Status recvv(std::vector<iovec>& iov, Deadline deadline);
  // Reads and discards exactly `len` bytes (to resynchronise after rejecting a payload).
  Status discard(uint64_t len, Deadline deadline);
  // Blocks until data (or EOF) is readable (spinning first, see setReceiveSpin). kLinkFailed after
  // shutdown().
  Status waitReadable(Deadline deadline);

  // Before blocking in poll(2) for incoming data, retry the receive for up to `us` microseconds.
  // A requester waiting for a short reply then avoids a sleep/wake-up cycle, which on loopback
  // costs more than the round trip itself (about 50 vs 20 us on a 2-core VM). 0 (default): never.
  void setReceiveSpin(int us) { spin_us_ = us; }

  // Wakes any blocked I/O and makes further I/O fail. Idempotent; the fd stays open until
  // destruction so that no other thread can be handed the same fd number meanwhile.
  void shutdown();

 private:
  Status waitFor(short events, Deadline deadline, const char* what);
  Status ioError(const char* what, int err) const;

  int fd_ = -1;
  int spin_us_ = 0;
  std::string peer_;
};

// Listening socket bound to ip:port (port 0 picks a free port; see port()).
class ListenSocket {
 public:
  static Result<ListenSocket> bind(const std::string& ip, uint16_t port);
  ListenSocket() = default;
  ~ListenSocket();
  ListenSocket(ListenSocket&& other) noexcept;
  ListenSocket& operator=(ListenSocket&& other) noexcept;

  uint16_t port() const { return port_; }
  int fd() const { return fd_; }
  // Accepts one connection if one is pending (non-blocking); invalid Socket if none.
  Socket acceptOne();

 private:
  int fd_ = -1;
  uint16_t port_ = 0;
};

}  // namespace pdlink
