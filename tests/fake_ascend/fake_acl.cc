// fake_acl.cc -> libascendcl.so: a fake Huawei ACL runtime for CPU-only tests of pdlink's Ascend
// backend, written from the public API description (docs spec "ascend_acl_hccl.md" §1, §6.2). It is
// meant to be strict where the real runtime is strict, so that backend bugs show up on CPU.
//
// Modelled:
//  * aclInit once per process (a repeat returns 100002), 100001 before aclInit, aclFinalize.
//  * The current device/context is per THREAD: a thread that has not called aclrtSetDevice or
//    aclrtSetCurrentContext gets 107002 from every call that needs a device.
//  * Device memory the host cannot touch: each device is an arena in a sparse memfd, mapped
//    PROT_NONE at the addresses handed out (a host dereference or process_vm_readv faults, as on
//    hardware) and mapped again read-write as a shadow that only the fakes use. First-fit allocator;
//    >= 1 MiB allocations are 2 MiB aligned (what HCCS/RDMA registration needs), others 512 bytes.
//  * Strict memcpy: count <= destMax, pointer kinds must match `kind`, every device range must lie
//    inside one live allocation (or one IPC-imported region). Peer access between devices is on.
//  * Streams are worker threads with FIFO queues: aclrtMemcpyAsync validates at once but the bytes
//    land only when the worker runs the copy (FAKE_ASCEND_STREAM_DELAY_US slows every task down).
//    Synchronize reports the first failed task once; events are markers in the queue.
//  * IPC export/import of device memory between processes of one host. The exporter serves imports
//    from a thread on an abstract Unix socket named after its pid, passes the arena memfd with
//    SCM_RIGHTS and checks the importer's pid (SO_PEERCRED) against aclrtIpcMemSetImportPid.
//  * Fault injection and call counters (fake_control.h); per-thread aclGetRecentErrMsg text.
// Not modelled: kernels, memset, extra contexts (aclrtCreateContext), stream flags and priorities,
// device reset freeing anything (it only unbinds the caller), aclFinalize releasing resources, the
// real allocator's padding, realistic timing. Process-wide objects are leaked on purpose: stream
// workers and the IPC server may still run while static destructors do at exit.
//
// Environment: FAKE_ASCEND_DEVICE_COUNT (2), FAKE_ASCEND_PHY_OFFSET (0), FAKE_ASCEND_DEVICE_MEMORY
// (8G, read when a device is first used), FAKE_ASCEND_STREAM_DELAY_US (0, read before each stream
// task), FAKE_ASCEND_INJECT (see fake_control.h).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

// Everything declared by these two headers is part of the library's interface: give it default
// visibility (the build uses -fvisibility=hidden and a version script for everything else).
#pragma GCC visibility push(default)
#include "backends/ascend/ascend_min.h"
#include "fake_control.h"
#pragma GCC visibility pop
#include "fake_internal.h"

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr int kMaxDevices = 64;
constexpr uint32_t kCtxMagic = 0xC0C7'0001, kStreamMagic = 0x5743'0002, kEventMagic = 0xE7E7'0003;

uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// ------------------------------------------------------------------ errors, counters, injection

thread_local std::string t_err;

__attribute__((format(printf, 3, 4))) int fail(const char* fn, int rc, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  t_err = std::string(fn) + ": " + buf + " (error " + std::to_string(rc) + ")";
  return rc;
}

struct Injection {
  int rc;
  long after_n, times, passed;
};

struct Control {
  std::mutex mu;
  std::map<std::string, long> calls;
  std::map<std::string, Injection> inject;
};

Control& control() {
  static Control* ctl = [] {
    auto* c = new Control;
    // FAKE_ASCEND_INJECT="fn:rc:after_n:times;..." lets a test arm a peer process before it loads.
    if (const char* spec = getenv("FAKE_ASCEND_INJECT")) {
      std::string s(spec);
      for (size_t pos = 0; pos < s.size();) {
        size_t end = s.find(';', pos);
        if (end == std::string::npos) end = s.size();
        char name[128];
        int rc, after, times;
        if (sscanf(s.substr(pos, end - pos).c_str(), " %127[^:]:%d:%d:%d", name, &rc, &after, &times) == 4)
          c->inject[name] = {rc, after, times, 0};
        pos = end + 1;
      }
    }
    return c;
  }();
  return *ctl;
}

int enter(const char* fn) {
  Control& c = control();
  std::lock_guard<std::mutex> lk(c.mu);
  c.calls[fn]++;
  auto it = c.inject.find(fn);
  if (it == c.inject.end()) return 0;
  Injection& in = it->second;
  if (in.passed < in.after_n || in.times == 0) {
    in.passed++;
    return 0;
  }
  if (in.times > 0) in.times--;
  return in.rc;
}

// ------------------------------------------------------------------------------ devices, runtime

struct Stream;

struct Context {
  uint32_t magic;
  int device;
};

struct Alloc {
  uint64_t size, reserved;
};

struct Device {
  int id = 0;
  int memfd = -1;
  char* base = nullptr;    // PROT_NONE view: the addresses callers see
  char* shadow = nullptr;  // RW view of the same pages, used only inside the fakes
  uint64_t size = 0;
  Context ctx{};                             // the default context; stable for the life of the process
  std::mutex mu;                             // guards the allocator and the default stream
  std::map<uint64_t, uint64_t> free_blocks;  // offset -> length
  std::map<uint64_t, Alloc> allocs;          // offset -> live allocation
  uint64_t in_use = 0;
  std::shared_ptr<Stream> default_stream;
};

struct Runtime {
  std::mutex mu;
  std::atomic<bool> initialized{false};
  bool configured = false;
  int device_count = 0, phy_offset = 0;
  std::atomic<Device*> devices[kMaxDevices]{};
};

Runtime& rt() {
  static Runtime* r = new Runtime;
  return *r;
}

thread_local int t_device = -1;

// The device, created on first use: arena memfd of FAKE_ASCEND_DEVICE_MEMORY bytes, mapped twice.
Device* get_device(const char* fn, int id, int* rc) {
  Runtime& r = rt();
  if (Device* d = r.devices[id].load()) return d;
  std::lock_guard<std::mutex> lk(r.mu);
  if (Device* d = r.devices[id].load()) return d;
  uint64_t size = round_up(fake::env_size("FAKE_ASCEND_DEVICE_MEMORY", 8ull << 30), 2 * kMiB);
  char name[32];
  snprintf(name, sizeof name, "fake-ascend-dev%d", id);
  int fd = memfd_create(name, MFD_CLOEXEC);
  void* base = MAP_FAILED;
  void* shadow = MAP_FAILED;
  if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
    // The visible view starts on a 2 MiB boundary, so 2 MiB-aligned offsets are aligned addresses:
    // reserve 2 MiB more, map the arena over the aligned part, drop the rest.
    void* raw = mmap(nullptr, size + 2 * kMiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw != MAP_FAILED) {
      char* r = static_cast<char*>(raw);
      char* aligned = reinterpret_cast<char*>(round_up(reinterpret_cast<uint64_t>(r), 2 * kMiB));
      base = mmap(aligned, size, PROT_NONE, MAP_SHARED | MAP_FIXED | MAP_NORESERVE, fd, 0);
      if (aligned > r) munmap(r, static_cast<size_t>(aligned - r));
      munmap(aligned + size, static_cast<size_t>(r + size + 2 * kMiB - (aligned + size)));
    }
    shadow = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  }
  if (base == MAP_FAILED || shadow == MAP_FAILED) {
    int e = errno;
    if (base != MAP_FAILED) munmap(base, size);
    if (shadow != MAP_FAILED) munmap(shadow, size);
    if (fd >= 0) close(fd);
    *rc = fail(fn, ACL_ERROR_RT_DRV_INTERNAL_ERROR, "cannot create the arena of device %d: %s", id, strerror(e));
    return nullptr;
  }
  auto* d = new Device;
  d->id = id;
  d->memfd = fd;
  d->base = static_cast<char*>(base);
  d->shadow = static_cast<char*>(shadow);
  d->size = size;
  d->ctx = {kCtxMagic, id};
  d->free_blocks[0] = size;
  r.devices[id].store(d);
  return d;
}

Device* current_device() { return t_device >= 0 ? rt().devices[t_device].load() : nullptr; }

enum : unsigned { kInit = 1, kDev = 2 };

// Common prologue: count the call, apply injection, then check aclInit and the thread's device.
int begin(const char* fn, unsigned needs, Device** dev = nullptr) {
  if (int rc = enter(fn)) return fail(fn, rc, "injected failure");
  if (needs && !rt().initialized) return fail(fn, ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
  if (needs & kDev) {
    Device* d = current_device();
    if (!d)
      return fail(fn, ACL_ERROR_RT_CONTEXT_NULL,
                  "no current device or context on this thread (call aclrtSetDevice or "
                  "aclrtSetCurrentContext on this thread first)");
    if (dev) *dev = d;
  }
  return 0;
}

int check_device_id(const char* fn, int32_t id) {
  if (id < 0 || id >= rt().device_count)
    return fail(fn, ACL_ERROR_RT_INVALID_DEVICEID, "device %d out of range [0, %d)", id, rt().device_count);
  return 0;
}

// ----------------------------------------------------------------------------- memory lookups

struct Import {  // an IPC-imported region in this process
  std::string key;
  char* base;    // PROT_NONE mapping (page aligned)
  char* shadow;  // RW mapping of the same pages
  size_t map_len;
  char* user;  // the address handed out (base + offset within the first page)
  uint64_t size;
  int fd;             // the exporter's arena memfd
  uint64_t file_off;  // file offset of `base`
  uint64_t file_size;
  int device;
};

struct Export {
  int device;
  uint64_t off, size, flags;
  std::set<int> pids;
};

struct Ipc {
  std::mutex mu;
  std::map<std::string, Export> exports;
  std::vector<Import> imports;
  bool serving = false;
};

Ipc& ipc() {
  static Ipc* i = new Ipc;
  return *i;
}

enum class Where { kHost, kDevice, kBad };

bool overlaps(const char* p, size_t n, const char* b, size_t len) { return p < b + len && p + n > b; }

// Classifies [p, p+n): inside one live device allocation or imported region (kDevice, *out filled),
// touching device address space otherwise (kBad), or plain host memory (kHost).
Where locate(const void* vp, size_t n, fake::DevRange* out) {
  const char* p = static_cast<const char*>(vp);
  size_t len = n ? n : 1;
  for (int i = 0; i < kMaxDevices; ++i) {
    Device* d = rt().devices[i].load();
    if (!d || !overlaps(p, len, d->base, d->size)) continue;
    if (p < d->base || p + len > d->base + d->size) return Where::kBad;
    uint64_t off = static_cast<uint64_t>(p - d->base);
    std::lock_guard<std::mutex> lk(d->mu);
    auto it = d->allocs.upper_bound(off);
    if (it == d->allocs.begin()) return Where::kBad;
    --it;
    if (off + len > it->first + it->second.size) return Where::kBad;
    *out = {d->shadow + off, d->memfd, off, d->size, d->id};
    return Where::kDevice;
  }
  std::lock_guard<std::mutex> lk(ipc().mu);
  for (const Import& im : ipc().imports) {
    if (!overlaps(p, len, im.base, im.map_len)) continue;
    if (p < im.user || p + len > im.user + im.size) return Where::kBad;
    uint64_t delta = static_cast<uint64_t>(p - im.base);
    *out = {im.shadow + delta, im.fd, im.file_off + delta, im.file_size, im.device};
    return Where::kDevice;
  }
  return Where::kHost;
}

const char* where_name(Where w) {
  return w == Where::kHost ? "host" : w == Where::kDevice ? "device" : "unknown device";
}

// Validates one copy and resolves both ends to pointers the fake may touch (shadows for device).
int prepare_copy(const char* fn, void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                 char** d, const char** s) {
  if (!dst || !src) return fail(fn, ACL_ERROR_INVALID_PARAM, "null pointer (dst %p, src %p)", dst, src);
  if (count > destMax) return fail(fn, ACL_ERROR_INVALID_PARAM, "count %zu > destMax %zu", count, destMax);
  if (kind < ACL_MEMCPY_HOST_TO_HOST || kind > ACL_MEMCPY_DEFAULT)
    return fail(fn, ACL_ERROR_INVALID_PARAM, "unsupported memcpy kind %d", static_cast<int>(kind));
  fake::DevRange dr{}, sr{};
  Where wd = locate(dst, count, &dr), ws = locate(src, count, &sr);
  if (wd == Where::kBad)
    return fail(fn, ACL_ERROR_INVALID_PARAM, "dst [%p, +%zu) is not inside one live device allocation", dst, count);
  if (ws == Where::kBad)
    return fail(fn, ACL_ERROR_INVALID_PARAM, "src [%p, +%zu) is not inside one live device allocation", src, count);
  static const Where kWant[4][2] = {{Where::kHost, Where::kHost},
                                    {Where::kDevice, Where::kHost},
                                    {Where::kHost, Where::kDevice},
                                    {Where::kDevice, Where::kDevice}};
  if (kind != ACL_MEMCPY_DEFAULT && (kWant[kind][0] != wd || kWant[kind][1] != ws))
    return fail(fn, ACL_ERROR_INVALID_PARAM, "kind %d does not match the pointers (dst is %s memory, src is %s memory)",
                static_cast<int>(kind), where_name(wd), where_name(ws));
  *d = wd == Where::kDevice ? dr.shadow : static_cast<char*>(dst);
  *s = ws == Where::kDevice ? sr.shadow : static_cast<const char*>(src);
  return 0;
}

// --------------------------------------------------------------------------- streams, events

struct Task {
  std::function<int()> fn;
  std::string what;
};

struct Stream {
  uint32_t magic = kStreamMagic;
  int device = 0;
  std::mutex mu;
  std::condition_variable cv;  // signalled on every queue change (worker and waiters share it)
  std::deque<Task> queue;
  bool busy = false, stop = false;
  int err = 0;  // first failure since the last synchronize
  std::string err_text;
  std::thread worker;

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !queue.empty(); });
      if (queue.empty()) return;  // stopping, and drained
      Task t = std::move(queue.front());
      queue.pop_front();
      busy = true;
      lk.unlock();
      // Read per task, so a test can slow down even the default streams it did not create.
      if (uint64_t us = fake::env_size("FAKE_ASCEND_STREAM_DELAY_US", 0))
        std::this_thread::sleep_for(std::chrono::microseconds(us));
      int rc = t.fn();
      t.fn = nullptr;  // drop captured state (e.g. a communicator) outside the lock
      lk.lock();
      busy = false;
      if (rc != 0 && err == 0) {
        err = ACL_ERROR_RT_INTERNAL_ERROR;
        err_text = t.what + " failed on the stream (HcclResult " + std::to_string(rc) + ")";
      }
      cv.notify_all();
    }
  }
};

std::shared_ptr<Stream> start_stream(int device) {
  auto s = std::make_shared<Stream>();
  s->device = device;
  Stream* raw = s.get();  // the worker is joined before the Stream can be freed
  s->worker = std::thread([raw] { raw->run(); });
  return s;
}

struct Event {
  uint32_t magic = kEventMagic;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, done = 0;  // generations: the latest record, the latest one reached
};

struct Handles {
  std::mutex mu;
  std::map<void*, std::shared_ptr<Stream>> streams;
  std::map<void*, std::shared_ptr<Event>> events;
  std::map<void*, size_t> host;  // aclrtMallocHost blocks
};

Handles& handles() {
  static Handles* h = new Handles;
  return *h;
}

// nullptr means the default stream of the calling thread's device.
int resolve_stream(const char* fn, aclrtStream s, Device* d, std::shared_ptr<Stream>* out) {
  if (!s) {
    std::lock_guard<std::mutex> lk(d->mu);
    if (!d->default_stream) d->default_stream = start_stream(d->id);  // never destroyed
    *out = d->default_stream;
    return 0;
  }
  std::lock_guard<std::mutex> lk(handles().mu);
  auto it = handles().streams.find(s);
  if (it == handles().streams.end()) return fail(fn, ACL_ERROR_INVALID_PARAM, "unknown stream %p", s);
  *out = it->second;
  return 0;
}

std::shared_ptr<Event> find_event(void* e) {
  std::lock_guard<std::mutex> lk(handles().mu);
  auto it = handles().events.find(e);
  return it == handles().events.end() ? nullptr : it->second;
}

void push(Stream& s, std::function<int()> fn, const char* what) {
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.queue.push_back({std::move(fn), what});
  }
  s.cv.notify_all();
}

int sync_stream(const char* fn, Stream& s, int32_t timeout_ms) {
  std::unique_lock<std::mutex> lk(s.mu);
  auto idle = [&] { return s.queue.empty() && !s.busy; };
  if (timeout_ms < 0) {
    s.cv.wait(lk, idle);
  } else if (!s.cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), idle)) {
    return fail(fn, ACL_ERROR_RT_STREAM_SYNC_TIMEOUT, "%zu task(s) still pending after %d ms",
                s.queue.size() + (s.busy ? 1 : 0), timeout_ms);
  }
  if (s.err) {
    int rc = s.err;
    std::string text = s.err_text;
    s.err = 0;
    return fail(fn, rc, "%s", text.c_str());
  }
  return 0;
}

// ------------------------------------------------------------------------------------ IPC

constexpr char kKeyPrefix[] = "fakeipc";

std::string ipc_socket_name(int pid) { return "pdlink-fake-acl-ipc." + std::to_string(pid); }

struct IpcReply {
  int32_t rc;
  int32_t device;
  uint64_t off, size, file_size;
};

// Serves imports, one short connection at a time: request = the 65-byte key, reply = IpcReply plus
// the arena memfd. Timeouts keep a silent client from blocking the server for long.
void ipc_serve(int lfd) {
  for (;;) {
    int c = accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      return;
    }
    char key[kAclIpcKeyBytes + 1] = {};
    if (fake::sock_recv(c, key, kAclIpcKeyBytes, 2000) == 0) {
      ucred cred{};
      socklen_t cl = sizeof cred;
      getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl);
      IpcReply rep{};
      int fd = -1;
      {
        std::lock_guard<std::mutex> lk(ipc().mu);
        auto it = ipc().exports.find(key);
        if (it == ipc().exports.end()) {
          rep.rc = ACL_ERROR_INVALID_PARAM;
        } else if (!(it->second.flags & ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION) &&
                   !it->second.pids.count(cred.pid)) {
          rep.rc = ACL_ERROR_RT_NO_PERMISSION;
        } else {
          Device* d = rt().devices[it->second.device].load();
          rep = {0, d->id, it->second.off, it->second.size, d->size};
          fd = d->memfd;
        }
      }
      fake::sock_send(c, &rep, sizeof rep, 2000, fd >= 0 ? &fd : nullptr, fd >= 0 ? 1 : 0);
    }
    close(c);
  }
}

// Starts the import server on first export. Called with ipc().mu held.
[[maybe_unused]] int ensure_ipc_server(const char* fn) {  // unused when FAKE_OMIT_OPTIONAL
  if (ipc().serving) return 0;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a;
  socklen_t alen = fake::abstract_addr(ipc_socket_name(getpid()), &a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), alen) != 0 || listen(fd, 64) != 0) {
    int e = errno;
    if (fd >= 0) close(fd);
    return fail(fn, ACL_ERROR_RT_DRV_INTERNAL_ERROR, "cannot start the IPC server: %s", strerror(e));
  }
  std::thread(ipc_serve, fd).detach();
  ipc().serving = true;
  return 0;
}

}  // namespace

// ================================================================================ exported API

extern "C" {

aclError aclInit(const char* /*configPath*/) {
  if (int rc = begin(__func__, 0)) return rc;
  Runtime& r = rt();
  std::lock_guard<std::mutex> lk(r.mu);
  if (r.initialized) return fail(__func__, ACL_ERROR_REPEAT_INITIALIZE, "already initialised in this process");
  if (!r.configured) {  // the device layout is fixed at the first aclInit of the process
    uint64_t n = fake::env_size("FAKE_ASCEND_DEVICE_COUNT", 2);
    r.device_count = static_cast<int>(n > kMaxDevices ? kMaxDevices : n);
    r.phy_offset = static_cast<int>(fake::env_size("FAKE_ASCEND_PHY_OFFSET", 0));
    r.configured = true;
  }
  r.initialized = true;
  return ACL_SUCCESS;
}

aclError aclFinalize(void) {
  if (int rc = begin(__func__, 0)) return rc;
  Runtime& r = rt();
  std::lock_guard<std::mutex> lk(r.mu);
  if (!r.initialized) return fail(__func__, ACL_ERROR_REPEAT_FINALIZE, "not initialised (or already finalised)");
  r.initialized = false;
  return ACL_SUCCESS;
}

aclError aclrtSetDevice(int32_t deviceId) {
  if (int rc = begin(__func__, kInit)) return rc;
  if (int rc = check_device_id(__func__, deviceId)) return rc;
  int rc = 0;
  if (!get_device(__func__, deviceId, &rc)) return rc;
  t_device = deviceId;
  return ACL_SUCCESS;
}

aclError aclrtResetDevice(int32_t deviceId) {
  if (int rc = begin(__func__, kInit)) return rc;
  if (int rc = check_device_id(__func__, deviceId)) return rc;
  if (t_device == deviceId) t_device = -1;  // only unbinds: memory and streams stay valid
  return ACL_SUCCESS;
}

aclError aclrtGetDevice(int32_t* deviceId) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  if (!deviceId) return fail(__func__, ACL_ERROR_INVALID_PARAM, "deviceId is null");
  *deviceId = d->id;
  return ACL_SUCCESS;
}

aclError aclrtGetDeviceCount(uint32_t* count) {
  if (int rc = begin(__func__, kInit)) return rc;
  if (!count) return fail(__func__, ACL_ERROR_INVALID_PARAM, "count is null");
  *count = static_cast<uint32_t>(rt().device_count);
  return ACL_SUCCESS;
}

aclError aclrtGetCurrentContext(aclrtContext* context) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  if (!context) return fail(__func__, ACL_ERROR_INVALID_PARAM, "context is null");
  *context = &d->ctx;
  return ACL_SUCCESS;
}

aclError aclrtSetCurrentContext(aclrtContext context) {
  if (int rc = begin(__func__, kInit)) return rc;
  for (int i = 0; i < kMaxDevices; ++i) {
    Device* d = rt().devices[i].load();
    if (d && context == &d->ctx) {
      t_device = i;
      return ACL_SUCCESS;
    }
  }
  return fail(__func__, ACL_ERROR_INVALID_PARAM, "unknown context %p", context);
}

aclError aclrtCreateStream(aclrtStream* stream) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  if (!stream) return fail(__func__, ACL_ERROR_INVALID_PARAM, "stream is null");
  auto s = start_stream(d->id);
  std::lock_guard<std::mutex> lk(handles().mu);
  handles().streams[s.get()] = s;
  *stream = s.get();
  return ACL_SUCCESS;
}

aclError aclrtDestroyStream(aclrtStream stream) {
  if (int rc = begin(__func__, kDev)) return rc;
  std::shared_ptr<Stream> s;
  {
    std::lock_guard<std::mutex> lk(handles().mu);
    auto it = handles().streams.find(stream);
    if (it == handles().streams.end()) return fail(__func__, ACL_ERROR_INVALID_PARAM, "unknown stream %p", stream);
    s = it->second;
    handles().streams.erase(it);
  }
  {
    std::lock_guard<std::mutex> lk(s->mu);
    s->stop = true;  // the worker drains what is queued, then exits
  }
  s->cv.notify_all();
  s->worker.join();
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeStream(aclrtStream stream) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  std::shared_ptr<Stream> s;
  if (int rc = resolve_stream(__func__, stream, d, &s)) return rc;
  return sync_stream(__func__, *s, -1);
}

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  std::shared_ptr<Stream> s;
  if (int rc = resolve_stream(__func__, stream, d, &s)) return rc;
  return sync_stream(__func__, *s, timeout < 0 ? -1 : timeout);
}

aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy /*policy*/) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  if (!devPtr || size == 0) return fail(__func__, ACL_ERROR_INVALID_PARAM, "devPtr %p, size %zu", devPtr, size);
  uint64_t align = size >= kMiB ? 2 * kMiB : 512;
  uint64_t reserved = round_up(size, align);
  std::lock_guard<std::mutex> lk(d->mu);
  for (auto it = d->free_blocks.begin(); it != d->free_blocks.end(); ++it) {  // first fit
    uint64_t start = round_up(it->first, align), blk = it->first, end = it->first + it->second;
    if (start + reserved > end) continue;
    d->free_blocks.erase(it);
    if (start > blk) d->free_blocks[blk] = start - blk;
    if (start + reserved < end) d->free_blocks[start + reserved] = end - start - reserved;
    d->allocs[start] = {size, reserved};
    d->in_use += size;
    *devPtr = d->base + start;
    return ACL_SUCCESS;
  }
  return fail(__func__, ACL_ERROR_RT_MEMORY_ALLOCATION, "device %d: no free range of %zu bytes (%llu in use of %llu)",
              d->id, size, static_cast<unsigned long long>(d->in_use), static_cast<unsigned long long>(d->size));
}

aclError aclrtFree(void* devPtr) {
  if (int rc = begin(__func__, kDev)) return rc;
  char* p = static_cast<char*>(devPtr);
  for (int i = 0; p && i < kMaxDevices; ++i) {
    Device* d = rt().devices[i].load();
    if (!d || p < d->base || p >= d->base + d->size) continue;
    std::lock_guard<std::mutex> lk(d->mu);
    auto it = d->allocs.find(static_cast<uint64_t>(p - d->base));
    if (it == d->allocs.end()) break;
    uint64_t off = it->first, len = it->second.reserved;
    d->in_use -= it->second.size;
    d->allocs.erase(it);
    // Give the pages back to the kernel, then merge with the free neighbours.
    fallocate(d->memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(off), static_cast<off_t>(len));
    auto next = d->free_blocks.lower_bound(off);
    if (next != d->free_blocks.end() && next->first == off + len) {
      len += next->second;
      d->free_blocks.erase(next);
    }
    auto prev = d->free_blocks.lower_bound(off);
    if (prev != d->free_blocks.begin()) --prev;
    if (prev != d->free_blocks.end() && prev->first + prev->second == off) {
      prev->second += len;
    } else {
      d->free_blocks[off] = len;
    }
    return ACL_SUCCESS;
  }
  return fail(__func__, ACL_ERROR_INVALID_PARAM, "%p is not the start of a live device allocation", devPtr);
}

aclError aclrtMallocHost(void** hostPtr, size_t size) {
  if (int rc = begin(__func__, kDev)) return rc;
  if (!hostPtr || size == 0) return fail(__func__, ACL_ERROR_INVALID_PARAM, "hostPtr %p, size %zu", hostPtr, size);
  void* p = nullptr;
  if (posix_memalign(&p, 4096, size) != 0)
    return fail(__func__, ACL_ERROR_RT_MEMORY_ALLOCATION, "cannot allocate %zu host bytes", size);
  std::lock_guard<std::mutex> lk(handles().mu);
  handles().host[p] = size;
  *hostPtr = p;
  return ACL_SUCCESS;
}

aclError aclrtFreeHost(void* hostPtr) {
  if (int rc = begin(__func__, kDev)) return rc;
  std::lock_guard<std::mutex> lk(handles().mu);
  if (!handles().host.erase(hostPtr))
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "%p was not allocated with aclrtMallocHost", hostPtr);
  free(hostPtr);
  return ACL_SUCCESS;
}

aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind) {
  if (int rc = begin(__func__, kDev)) return rc;
  char* d = nullptr;
  const char* s = nullptr;
  if (int rc = prepare_copy(__func__, dst, destMax, src, count, kind, &d, &s)) return rc;
  if (count) memmove(d, s, count);
  return ACL_SUCCESS;
}

#ifndef FAKE_OMIT_REQUIRED  // the "broken" build lacks this required symbol
aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream) {
  Device* dev = nullptr;
  if (int rc = begin(__func__, kDev, &dev)) return rc;
  char* d = nullptr;
  const char* s = nullptr;
  if (int rc = prepare_copy(__func__, dst, destMax, src, count, kind, &d, &s)) return rc;
  std::shared_ptr<Stream> st;
  if (int rc = resolve_stream(__func__, stream, dev, &st)) return rc;
  // Host buffers are read/written when the task runs, as with the real DMA engine.
  push(
      *st,
      [d, s, count] {
        if (count) memmove(d, s, count);
        return 0;
      },
      __func__);
  return ACL_SUCCESS;
}
#endif

aclError aclrtCreateEvent(aclrtEvent* event) {
  if (int rc = begin(__func__, kDev)) return rc;
  if (!event) return fail(__func__, ACL_ERROR_INVALID_PARAM, "event is null");
  auto e = std::make_shared<Event>();
  std::lock_guard<std::mutex> lk(handles().mu);
  handles().events[e.get()] = e;
  *event = e.get();
  return ACL_SUCCESS;
}

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  Device* d = nullptr;
  if (int rc = begin(__func__, kDev, &d)) return rc;
  auto e = find_event(event);
  if (!e) return fail(__func__, ACL_ERROR_INVALID_PARAM, "unknown event %p", event);
  std::shared_ptr<Stream> s;
  if (int rc = resolve_stream(__func__, stream, d, &s)) return rc;
  uint64_t gen;
  {
    std::lock_guard<std::mutex> lk(e->mu);
    gen = ++e->recorded;
  }
  push(
      *s,
      [e, gen] {
        {
          std::lock_guard<std::mutex> lk(e->mu);
          if (e->done < gen) e->done = gen;
        }
        e->cv.notify_all();
        return 0;
      },
      __func__);
  return ACL_SUCCESS;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
  if (int rc = begin(__func__, kDev)) return rc;
  auto e = find_event(event);
  if (!e) return fail(__func__, ACL_ERROR_INVALID_PARAM, "unknown event %p", event);
  std::unique_lock<std::mutex> lk(e->mu);
  uint64_t want = e->recorded;  // the latest record at the time of the call
  e->cv.wait(lk, [&] { return e->done >= want; });
  return ACL_SUCCESS;
}

aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus* status) {
  if (int rc = begin(__func__, kDev)) return rc;
  auto e = find_event(event);
  if (!e || !status) return fail(__func__, ACL_ERROR_INVALID_PARAM, "event %p, status %p", event, status);
  std::lock_guard<std::mutex> lk(e->mu);
  *status = e->done >= e->recorded ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
  return ACL_SUCCESS;
}

aclError aclrtDestroyEvent(aclrtEvent event) {
  if (int rc = begin(__func__, kDev)) return rc;
  std::lock_guard<std::mutex> lk(handles().mu);  // a queued marker keeps its own reference
  if (!handles().events.erase(event)) return fail(__func__, ACL_ERROR_INVALID_PARAM, "unknown event %p", event);
  return ACL_SUCCESS;
}

const char* aclGetRecentErrMsg(void) {
  enter(__func__);
  return t_err.c_str();
}

aclError aclrtGetPhyDevIdByLogicDevId(int32_t logicDevId, int32_t* phyDevId) {
  if (int rc = begin(__func__, kInit)) return rc;
  if (int rc = check_device_id(__func__, logicDevId)) return rc;
  if (!phyDevId) return fail(__func__, ACL_ERROR_INVALID_PARAM, "phyDevId is null");
  *phyDevId = logicDevId + rt().phy_offset;
  return ACL_SUCCESS;
}

#ifndef FAKE_OMIT_OPTIONAL  // the "broken" build lacks this optional symbol
aclError aclrtIpcMemGetExportKey(void* devPtr, size_t size, char* key, size_t len, uint64_t flags) {
  if (int rc = begin(__func__, kDev)) return rc;
  fake::DevRange r{};
  if (!devPtr || size == 0 || !key || locate(devPtr, size, &r) != Where::kDevice)
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "[%p, +%zu) is not inside one live device allocation", devPtr, size);
  Device* owner = rt().devices[r.device].load();
  if (!owner || r.memfd != owner->memfd)
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "%p is imported memory; only the owner can export it", devPtr);
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof nonce, 0) != sizeof nonce) nonce = static_cast<uint64_t>(std::rand());
  char buf[96];
  int n = snprintf(buf, sizeof buf, "%s:%d:%d:%llx:%zx:%016llx", kKeyPrefix, static_cast<int>(getpid()), r.device,
                   static_cast<unsigned long long>(r.file_off), size, static_cast<unsigned long long>(nonce));
  if (n < 0 || static_cast<size_t>(n) >= len || static_cast<size_t>(n) >= kAclIpcKeyBytes)
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "key buffer of %zu bytes is too small (need %d)", len, n + 1);
  std::lock_guard<std::mutex> lk(ipc().mu);
  if (int rc = ensure_ipc_server(__func__)) return rc;
  ipc().exports[buf] = {r.device, r.file_off, size, flags, {}};
  memcpy(key, buf, static_cast<size_t>(n) + 1);
  return ACL_SUCCESS;
}
#endif

aclError aclrtIpcMemSetImportPid(const char* key, int32_t* pid, size_t num) {
  if (int rc = begin(__func__, kDev)) return rc;
  if (!key || !pid || num == 0)
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "key %p, pid %p, num %zu", key, pid, num);
  std::lock_guard<std::mutex> lk(ipc().mu);
  auto it = ipc().exports.find(key);
  if (it == ipc().exports.end()) return fail(__func__, ACL_ERROR_INVALID_PARAM, "key '%s' is not exported here", key);
  it->second.pids.insert(pid, pid + num);
  return ACL_SUCCESS;
}

aclError aclrtIpcMemImportByKey(void** devPtr, const char* key, uint64_t /*flags: peer access is always on*/) {
  if (int rc = begin(__func__, kDev)) return rc;
  int pid = 0;
  if (!devPtr || !key || sscanf(key, "fakeipc:%d:", &pid) != 1)
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "malformed key '%s'", key ? key : "(null)");
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un a;
  socklen_t alen = fake::abstract_addr(ipc_socket_name(pid), &a);
  if (s < 0 || connect(s, reinterpret_cast<sockaddr*>(&a), alen) != 0) {
    if (s >= 0) close(s);
    return fail(__func__, ACL_ERROR_INVALID_PARAM, "key '%s': the exporting process %d is gone", key, pid);
  }
  char req[kAclIpcKeyBytes] = {};
  strncpy(req, key, kAclIpcKeyBytes - 1);
  IpcReply rep{};
  int fd = -1, nfd = 0;
  int e = fake::sock_send(s, req, sizeof req, 5000);
  if (!e) e = fake::sock_recv(s, &rep, sizeof rep, 5000, &fd, 1, &nfd);
  close(s);
  if (e)
    return fail(__func__, ACL_ERROR_RT_DRV_INTERNAL_ERROR, "key '%s': exporter did not answer: %s", key, strerror(e));
  if (rep.rc != 0 || nfd != 1) {
    if (nfd == 1) close(fd);
    return fail(__func__, rep.rc ? rep.rc : ACL_ERROR_RT_DRV_INTERNAL_ERROR, "key '%s' refused by process %d (%s)", key,
                pid, rep.rc == ACL_ERROR_RT_NO_PERMISSION ? "pid not whitelisted" : "unknown or closed key");
  }
  uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t moff = rep.off / page * page, delta = rep.off - moff;
  size_t len = round_up(delta + rep.size, page);
  void* base = mmap(nullptr, len, PROT_NONE, MAP_SHARED | MAP_NORESERVE, fd, static_cast<off_t>(moff));
  void* shadow = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, static_cast<off_t>(moff));
  if (base == MAP_FAILED || shadow == MAP_FAILED) {
    if (base != MAP_FAILED) munmap(base, len);
    if (shadow != MAP_FAILED) munmap(shadow, len);
    close(fd);
    return fail(__func__, ACL_ERROR_RT_DRV_INTERNAL_ERROR, "cannot map the imported region");
  }
  Import im{key,
            static_cast<char*>(base),
            static_cast<char*>(shadow),
            len,
            static_cast<char*>(base) + delta,
            rep.size,
            fd,
            moff,
            rep.file_size,
            rep.device};
  std::lock_guard<std::mutex> lk(ipc().mu);
  ipc().imports.push_back(im);
  *devPtr = im.user;
  return ACL_SUCCESS;
}

aclError aclrtIpcMemClose(const char* key) {
  if (int rc = begin(__func__, kDev)) return rc;
  if (!key) return fail(__func__, ACL_ERROR_INVALID_PARAM, "key is null");
  std::lock_guard<std::mutex> lk(ipc().mu);
  auto& ims = ipc().imports;
  for (auto it = ims.begin(); it != ims.end(); ++it) {
    if (it->key != key) continue;
    munmap(it->base, it->map_len);
    munmap(it->shadow, it->map_len);
    close(it->fd);
    ims.erase(it);
    return ACL_SUCCESS;
  }
  if (ipc().exports.erase(key)) return ACL_SUCCESS;  // later imports of this key are refused
  return fail(__func__, ACL_ERROR_INVALID_PARAM, "key '%s' is neither imported nor exported here", key);
}

aclError aclrtDeviceGetBareTgid(int32_t* pid) {
  if (int rc = begin(__func__, 0)) return rc;
  if (!pid) return fail(__func__, ACL_ERROR_INVALID_PARAM, "pid is null");
  *pid = static_cast<int32_t>(getpid());  // no container pid namespace in the fake
  return ACL_SUCCESS;
}

// ------------------------------------------------------------------------------ control API

int fake_ascend_inject(const char* fn, int rc, int after_n, int times) {
  Control& c = control();
  std::lock_guard<std::mutex> lk(c.mu);
  if (!fn)
    c.inject.clear();
  else
    c.inject[fn] = {rc, after_n, times, 0};
  return 0;
}

long fake_ascend_calls(const char* fn) {
  if (!fn) return 0;
  Control& c = control();
  std::lock_guard<std::mutex> lk(c.mu);
  auto it = c.calls.find(fn);
  return it == c.calls.end() ? 0 : it->second;
}

unsigned long long fake_acl_bytes_in_use(int device) {
  if (device < 0 || device >= kMaxDevices) return 0;
  Device* d = rt().devices[device].load();
  if (!d) return 0;
  std::lock_guard<std::mutex> lk(d->mu);
  return d->in_use;
}

int fake_acl_peek(const void* device_addr, void* host_dst, size_t n) {
  fake::DevRange r{};
  if (!host_dst || locate(device_addr, n, &r) != Where::kDevice) return -1;
  memcpy(host_dst, r.shadow, n);
  return 0;
}

int fake_acl_poke(void* device_addr, const void* host_src, size_t n) {
  fake::DevRange r{};
  if (!host_src || locate(device_addr, n, &r) != Where::kDevice) return -1;
  memcpy(r.shadow, host_src, n);
  return 0;
}

}  // extern "C"

// ------------------------------------------------------------------- hooks for the fake HCCL

namespace {

int hook_current_device(const char* fn) {
  if (!rt().initialized) {
    fail(fn, ACL_ERROR_UNINITIALIZE, "aclInit has not been called");
    return -1;
  }
  if (Device* d = current_device()) return d->id;
  fail(fn, ACL_ERROR_RT_CONTEXT_NULL, "no current device or context on this thread (call aclrtSetDevice first)");
  return -1;
}

int hook_fail(const char* fn, int rc, const char* text) { return fail(fn, rc, "%s", text); }

bool hook_lookup(const void* p, size_t n, fake::DevRange* out) { return p && locate(p, n, out) == Where::kDevice; }

int hook_enqueue(aclrtStream stream, std::function<int()> task, const char* what) {
  Device* d = current_device();
  if (!d) return fail(what, ACL_ERROR_RT_CONTEXT_NULL, "no current device or context on this thread");
  std::shared_ptr<Stream> s;
  if (int rc = resolve_stream(what, stream, d, &s)) return rc;
  push(*s, std::move(task), what);
  return ACL_SUCCESS;
}

const fake::Hooks kHooks = {fake::kHooksVersion, enter, hook_current_device, hook_fail, hook_lookup, hook_enqueue};

}  // namespace

extern "C" const fake::Hooks* fake_ascend_hooks(void) { return &kHooks; }
