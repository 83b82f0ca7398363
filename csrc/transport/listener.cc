#include "transport/listener.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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
  if (l->wake_fd_ < 0) return Status(Code::kFailed, std::string("eventfd failed: ") + std::strerror(errno));
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
  for (;;) {
    pollfd fds[2] = {{socket_.fd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;  // EINTR
    if (fds[1].revents) return;
    for (Socket s = socket_.acceptOne(); s.valid(); s = socket_.acceptOne()) on_accept_(std::move(s));
  }
}

}  // namespace pdlink
