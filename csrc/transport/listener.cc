#include "transport/listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/log.h"

namespace pdlink {

Result<std::unique_ptr<Listener>> Listener::start(const std::string& ip, uint16_t port, AcceptFn on_accept) {
  auto ls = ListenSocket::bind(ip, port);
  if (!ls.ok()) return Status(Code::kFailed, ls.status().message());
  return start(std::move(ls.value()), ip, std::move(on_accept));
}

Result<std::unique_ptr<Listener>> Listener::startUnix(const std::string& name, AcceptFn on_accept) {
  auto ls = ListenSocket::bindUnix(name);
  if (!ls.ok()) return ls.status();
  return start(std::move(ls.value()), "", std::move(on_accept));
}

Result<std::unique_ptr<Listener>> Listener::start(ListenSocket socket, std::string ip, AcceptFn on_accept) {
  std::unique_ptr<Listener> l(new Listener());
  l->ip_ = std::move(ip);
  l->socket_ = std::move(socket);
  l->on_accept_ = std::move(on_accept);
  l->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (l->wake_fd_ < 0)
    return Status(Code::kFailed, Scope::kEngine, std::string("eventfd failed: ") + std::strerror(errno));
  l->thread_ = std::thread([raw = l.get()] { raw->run(); });
  return l;
}

Listener::~Listener() {
  if (thread_.joinable()) {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd_, &one, sizeof(one));
    (void)ignored;
    thread_.join();
  }
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Listener::run() {
  bool backing_off = false;
  bool logged = false;  // this run of failures was logged; reset by the next accepted connection
  for (;;) {
    pollfd fds[2] = {{socket_.fd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // While backing off, only the stop request is waited for: the listening socket stays readable
    // (the connection it cannot accept is still queued), and polling it would spin.
    const int n = backing_off ? ::poll(fds + 1, 1, kBackoffMs) : ::poll(fds, 2, -1);
    if (n < 0) continue;  // EINTR
    if (fds[1].revents) return;
    backing_off = false;
    int error = 0;
    for (Socket s = socket_.acceptOne(&error); s.valid(); s = socket_.acceptOne(&error)) {
      logged = false;
      on_accept_(std::move(s));
    }
    if (error == 0) continue;
    backoffs_.fetch_add(1);
    backing_off = true;
    if (!logged) {
      PDLINK_LOG(kWarn, "cannot accept connections on " << (ip_.empty() ? "the same-host socket" : ip_) << ": "
                                                        << std::strerror(error) << "; retrying every " << kBackoffMs
                                                        << " ms until it can");
      logged = true;
    }
  }
}

}  // namespace pdlink
