// Listener: a bound listening socket (TCP, or an AF_UNIX abstract name) plus the thread that
// accepts on it.
//
// Ownership: owns the socket and the thread; the destructor stops the thread (through an eventfd)
// and joins it, so an accept callback never runs after destruction.
// Threading: `on_accept` runs on the listener's thread, once per accepted connection; it must not
// block for long (hand the socket to another thread). Destroy the Listener from a thread that holds
// no lock the callback takes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "core/status.h"
#include "transport/socket.h"

namespace pdlink {

class Listener {
 public:
  using AcceptFn = std::function<void(Socket)>;
  // Binds ip:port (0 = any free port) and starts accepting. kFailed with the OS reason when the
  // address cannot be bound.
  static Result<std::unique_ptr<Listener>> start(const std::string& ip, uint16_t port, AcceptFn on_accept);
  // Listens under an AF_UNIX abstract name (transport/socket.h) instead.
  static Result<std::unique_ptr<Listener>> startUnix(const std::string& name, AcceptFn on_accept);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  const std::string& ip() const { return ip_; }
  uint16_t port() const { return socket_.port(); }
  // How often accepting paused because the process (or system) was out of descriptors, or a
  // connection failed to be accepted for another reason: the listener then waits kBackoffMs
  // instead of spinning on a readable socket it cannot accept from, and logs it once per episode.
  uint64_t backoffs() const { return backoffs_.load(); }
  static constexpr int kBackoffMs = 100;

 private:
  Listener() = default;
  static Result<std::unique_ptr<Listener>> start(ListenSocket socket, std::string ip, AcceptFn on_accept);
  void run();

  std::string ip_;
  ListenSocket socket_;
  AcceptFn on_accept_;
  int wake_fd_ = -1;
  std::thread thread_;
  std::atomic<uint64_t> backoffs_{0};
};

}  // namespace pdlink
