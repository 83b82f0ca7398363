#include "transport/cma/cma.h"

#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

namespace pdlink::cma {
namespace {

constexpr size_t kMaxIov = 1024;             // IOV_MAX
constexpr size_t kSplitBytes = size_t{8} << 20;  // copies at least this large use two threads


Status copyRange(pid_t pid, bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote,
                 size_t begin, size_t end) {
  for (size_t i = begin; i < end; i += kMaxIov) {
    size_t n = std::min(kMaxIov, end - i);
    size_t want = 0;
    for (size_t k = 0; k < n; ++k) want += local[i + k].iov_len;
    ssize_t got = write ? ::process_vm_writev(pid, &local[i], n, &remote[i], n, 0)
                        : ::process_vm_readv(pid, &local[i], n, &remote[i], n, 0);
    if (got == static_cast<ssize_t>(want)) continue;
    int err = got < 0 ? errno : EFAULT;  // a short copy stops at an unmapped range
    Code code = (err == ESRCH || err == EPERM) ? Code::kLinkFailed : Code::kParamInvalid;
    return Status(code, std::string("direct memory ") + (write ? "write to" : "read from") + " pid " +
                            std::to_string(pid) + " failed: " + std::strerror(err));
  }
  return Status::OK();
}

}  // namespace

Status copy(pid_t pid, bool write, const std::vector<iovec>& local, const std::vector<iovec>& remote) {
  if (local.size() != remote.size()) return Status(Code::kParamInvalid, "direct copy: range lists differ");
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  // A large copy is split between this thread and a helper: the kernel copies page by page on
  // the calling CPU, so one thread leaves memory bandwidth unused (measured: bench/).
  if (total < kSplitBytes || local.size() < 2) return copyRange(pid, write, local, remote, 0, local.size());
  size_t half = 0, acc = 0;
  while (half < local.size() && acc < total / 2) acc += local[half++].iov_len;
  Status other;
  std::thread helper([&] { other = copyRange(pid, write, local, remote, half, local.size()); });
  Status mine = copyRange(pid, write, local, remote, 0, half);
  helper.join();
  return mine.ok() ? other : mine;
}

Result<uint64_t> readThenWord(pid_t pid, std::vector<iovec>& local, std::vector<iovec>& remote, uint64_t word_addr) {
  if (local.size() != remote.size()) return Status(Code::kParamInvalid, "direct copy: range lists differ");
  size_t total = 0;
  for (const iovec& v : local) total += v.iov_len;
  if (total >= kSplitBytes && local.size() >= 2) {  // split: no order between the halves and a word
    Status st = copy(pid, false, local, remote);
    if (!st.ok()) return st;
    return readWord(pid, word_addr);
  }
  uint64_t word = 0;
  local.push_back({&word, sizeof(word)});
  remote.push_back({reinterpret_cast<void*>(word_addr), sizeof(word)});
  Status st = copyRange(pid, false, local, remote, 0, local.size());  // one thread: the kernel copies in order
  local.pop_back();
  remote.pop_back();
  if (!st.ok()) return st;
  return word;
}

Result<uint64_t> readWord(pid_t pid, uint64_t addr) {
  uint64_t value = 0;
  iovec l{&value, sizeof(value)}, r{reinterpret_cast<void*>(addr), sizeof(value)};
  ssize_t got = ::process_vm_readv(pid, &l, 1, &r, 1, 0);
  if (got != static_cast<ssize_t>(sizeof(value))) {
    return Status(Code::kLinkFailed, std::string("direct memory access to pid ") + std::to_string(pid) +
                                         " is not permitted: " + std::strerror(got < 0 ? errno : EFAULT));
  }
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
