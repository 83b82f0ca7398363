// fake_hccl.cc -> libhccl.so: a fake HCCL for CPU-only tests of pdlink's Ascend backend, written from
// the public API description (docs spec "ascend_acl_hccl.md" §2, §6.2). Two real processes (or two
// threads) form a communicator over local Unix sockets and move real bytes between fake device
// memories (the fake ACL's arenas), so transfers, timeouts and peer failures happen for real.
//
// Modelled:
//  * Every call needs a current device on the calling thread (HCCL_E_RUNTIME otherwise; the ACL
//    error text says why).
//  * HcclGetRootInfo: a magic, a random nonce and the name of an abstract Unix socket this process
//    listens on. HcclCommInitRootInfo: two ranks only; rank 0 must be the creating process; the
//    joiner's nonce is checked; blocks until both joined or HCCL_CONNECT_TIMEOUT seconds.
//  * Send/Recv/BatchSendRecv validate at once (buffers must be live device memory) and run later as
//    tasks of the fake ACL stream. Items pair in order; each carries (count, dtype) that the
//    receiver checks (HCCL_E_PARA on mismatch). A sender's item completes only when the receiver
//    has taken it (an ack per item), like a rendezvous protocol on hardware. Waiting longer than
//    HCCL_EXEC_TIMEOUT seconds without progress fails with HCCL_E_TIMEOUT; a vanished peer with
//    HCCL_E_TCP_TRANSFER. Any failure during a transfer breaks the communicator for good (as after
//    an HCCL async error): the links are shut down, so the peer's pending work fails too, and
//    HcclGetCommAsyncError reports the first failure.
//  * One-sided API: registration of device memory, bind, a Prepare that swaps segment tables (and
//    arena memfds, SCM_RIGHTS), BatchPut/BatchGet as copies straight into the peer's mapped memory.
// Not modelled: more than 2 ranks, collectives, rank tables (HcclCommInitClusterInfo*), group
// calls, HcclCommConfig, host-memory registration, HCCS/RDMA topology and performance. Prepare must
// not overlap two-sided transfers on the same communicator (both use the same links).
//
// Link layout: two stream sockets per communicator, one per direction. A direction's socket carries
// the sender's frames one way and the receiver's acks the other, so neither side ever has to read
// acks and data from one socket (no demultiplexing, no lock held across both directions).

#include <poll.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#pragma GCC visibility push(default)
#include "backends/ascend/ascend_min.h"
#include "fake_control.h"
#pragma GCC visibility pop
#include "fake_internal.h"

namespace {

using Clock = std::chrono::steady_clock;

const fake::Hooks& H() { return *fake_ascend_hooks(); }

constexpr uint32_t kCommMagic = 0x4843'0C0C, kFrameMagic = 0xF4A3'E001, kHelloMagic = 0x4E11'0001,
                   kWelcomeMagic = 0x3E1C'0002;
constexpr char kRootMagic[8] = "FKHCCL1";

int timeout_ms(const char* env) { return static_cast<int>(fake::env_double(env, 120.0) * 1000.0); }

int ms_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left > 0 ? static_cast<int>(left) : 0;
}

uint64_t random64() {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, 0) != sizeof v) v = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  return v;
}

__attribute__((format(printf, 3, 4))) HcclResult fail(const char* fn, HcclResult r, const char* fmt, ...) {
  char buf[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  H().fail(fn, r, buf);  // visible through aclGetRecentErrMsg, which helps when a test fails
  return r;
}

// Count the call, apply injection, then require a current device on the calling thread.
#define HCCL_BEGIN()                                                                                            \
  do {                                                                                                          \
    if (int rc_ = H().enter(__func__)) return fail(__func__, static_cast<HcclResult>(rc_), "injected failure"); \
    if (H().current_device(__func__) < 0) return HCCL_E_RUNTIME;                                                \
  } while (0)

size_t dtype_size(int dt) {
  switch (dt) {
    case 0:
    case 7:
    case 14:
    case 15:
    case 16:
    case 17:
      return 1;  // INT8 UINT8 HIF8 FP8*
    case 1:
    case 3:
    case 8:
    case 11:
      return 2;  // INT16 FP16 UINT16 BFP16
    case 2:
    case 4:
    case 9:
      return 4;  // INT32 FP32 UINT32
    case 5:
    case 6:
    case 10:
      return 8;  // INT64 UINT64 FP64
    case 12:
      return 16;  // INT128
    default:
      return 0;
  }
}

// ------------------------------------------------------------------------------ communicators

struct RemoteSeg {  // a peer segment published by HcclCommPrepare
  uint64_t addr, size;
  char* shadow;  // where it is mapped here
};

struct Mem {  // HcclRegisterGlobalMem
  CommMem desc;
  fake::DevRange range;
};

struct Comm {
  uint32_t magic = kCommMagic;
  uint32_t rank = 0;
  int out_fd = -1;           // my items -> peer; the peer's acks come back on it
  int in_fd = -1;            // the peer's items -> me; my acks go back on it
  std::mutex out_mu, in_mu;  // one batch per direction at a time, so items pair in order
  std::atomic<bool> broken{false};
  std::atomic<int> async_err{HCCL_SUCCESS};
  std::mutex mem_mu;  // one-sided state below
  std::map<void*, std::shared_ptr<Mem>> bound;
  std::vector<RemoteSeg> remote;
  std::vector<std::pair<void*, size_t>> maps;  // peer arenas mapped into this process

  // Keeps the first failure as the communicator's async error.
  void record(HcclResult r) {
    int none = HCCL_SUCCESS;
    async_err.compare_exchange_strong(none, r);
  }
  // Records the failure and shuts both links, so every pending or later transfer on either side
  // fails promptly instead of waiting for its timeout.
  void fail(HcclResult r) {
    record(r);
    hangup();
  }
  void hangup() {
    broken = true;
    shutdown(out_fd, SHUT_RDWR);
    shutdown(in_fd, SHUT_RDWR);
  }
  void unmap_peers() {
    for (auto& m : maps) munmap(m.first, m.second);
    maps.clear();
    remote.clear();
  }
  ~Comm() {
    if (out_fd >= 0) close(out_fd);
    if (in_fd >= 0) close(in_fd);
    unmap_peers();
  }
};

struct Listener {
  int fd;
  uint64_t nonce;
};

struct Registry {
  std::mutex mu;
  std::map<void*, std::shared_ptr<Comm>> comms;
  std::map<std::string, Listener> listeners;  // root infos created here and not used yet
  std::map<void*, std::shared_ptr<Mem>> mems;
};

Registry& reg() {
  static Registry* r = new Registry;  // leaked: tasks may still run during exit
  return *r;
}

std::shared_ptr<Comm> find_comm(HcclComm comm) {
  std::lock_guard<std::mutex> lk(reg().mu);
  auto it = reg().comms.find(comm);
  return it == reg().comms.end() ? nullptr : it->second;
}

// ----------------------------------------------------------------------------- two-sided data

enum FrameType : uint32_t { kData = 1, kErrorMark = 2, kAck = 3, kTable = 4 };

struct Frame {
  uint32_t magic, type;
  uint64_t count;
  int32_t dtype, status;  // status: the sender's code in kErrorMark, the fd count in kTable
};

struct Item {
  char* shadow;
  uint64_t count;
  int dtype;
  size_t bytes;
};

HcclResult io_result(int e) { return e == 0 ? HCCL_SUCCESS : e == ETIMEDOUT ? HCCL_E_TIMEOUT : HCCL_E_TCP_TRANSFER; }

// *hangup: whether the failure should shut the links (not after an error marker, see below).
HcclResult send_items(Comm& c, const std::vector<Item>& items, int tmo, bool* hangup) {
  std::lock_guard<std::mutex> lk(c.out_mu);
  for (const Item& it : items) {
    if (c.broken) return HCCL_E_TCP_TRANSFER;
    if (H().enter("hccl.stall")) {
      // A link that stops moving data: wait, bounded, until the peer gives up and hangs up.
      return fake::wait_fd(c.out_fd, POLLIN, tmo) == ETIMEDOUT ? HCCL_E_TIMEOUT : HCCL_E_TCP_TRANSFER;
    }
    if (int rc = H().enter("hccl.remote_error")) {
      // What the receiver sees when the sending device fails mid-batch. This side records its
      // failure first and leaves the links up: the receiver hangs up once it has read the marker,
      // so it reports HCCL_E_REMOTE rather than whatever a racing hang-up would cause.
      c.record(static_cast<HcclResult>(rc));
      Frame f{kFrameMagic, kErrorMark, it.count, it.dtype, rc};
      fake::sock_send(c.out_fd, &f, sizeof f, tmo);
      *hangup = false;
      return static_cast<HcclResult>(rc);
    }
    Frame f{kFrameMagic, kData, it.count, it.dtype, 0}, ack{};
    int e = fake::sock_send(c.out_fd, &f, sizeof f, tmo);
    if (!e) e = fake::sock_send(c.out_fd, it.shadow, it.bytes, tmo);
    if (!e) e = fake::sock_recv(c.out_fd, &ack, sizeof ack, tmo);
    if (e) return io_result(e);
    if (ack.magic != kFrameMagic || ack.type != kAck) return HCCL_E_TCP_TRANSFER;
  }
  return HCCL_SUCCESS;
}

HcclResult recv_items(Comm& c, const std::vector<Item>& items, int tmo) {
  std::lock_guard<std::mutex> lk(c.in_mu);
  for (const Item& it : items) {
    if (c.broken) return HCCL_E_TCP_TRANSFER;
    Frame f{};
    if (int e = fake::sock_recv(c.in_fd, &f, sizeof f, tmo)) return io_result(e);
    if (f.magic != kFrameMagic) return HCCL_E_TCP_TRANSFER;
    if (f.type == kErrorMark) return HCCL_E_REMOTE;
    if (f.type != kData) return HCCL_E_TCP_TRANSFER;  // e.g. a Prepare overlapping transfers
    // A mismatch fails here; the caller then hangs up, which fails the sender waiting for its ack.
    if (f.count != it.count || f.dtype != it.dtype) return HCCL_E_PARA;
    if (int e = fake::sock_recv(c.in_fd, it.shadow, it.bytes, tmo)) return io_result(e);
    Frame ack{kFrameMagic, kAck, it.count, it.dtype, 0};
    if (int e = fake::sock_send(c.in_fd, &ack, sizeof ack, tmo)) return io_result(e);
  }
  return HCCL_SUCCESS;
}

// The stream task of one Send/Recv/BatchSendRecv.
int run_batch(const std::shared_ptr<Comm>& c, const std::vector<Item>& sends, const std::vector<Item>& recvs) {
  int tmo = timeout_ms("HCCL_EXEC_TIMEOUT");
  HcclResult rs = HCCL_SUCCESS, rr = HCCL_SUCCESS;
  auto do_sends = [&] {
    bool hangup = true;
    rs = send_items(*c, sends, tmo, &hangup);
    if (rs && hangup) c->fail(rs);
  };
  // Sends run on a helper thread while this thread receives: both ranks may batch sends and
  // receives at the same time, and a send completes only once the peer receives it.
  std::thread helper;
  if (!sends.empty() && !recvs.empty())
    helper = std::thread(do_sends);
  else if (!sends.empty())
    do_sends();
  if (!recvs.empty()) {
    rr = recv_items(*c, recvs, tmo);
    if (rr) c->fail(rr);
  }
  if (helper.joinable()) helper.join();
  return rs == HCCL_SUCCESS && rr == HCCL_SUCCESS ? 0 : c->async_err.load();
}

HcclResult submit(const char* fn, const HcclSendRecvItem* info, uint32_t n, HcclComm comm, aclrtStream stream) {
  auto c = find_comm(comm);
  if (!c) return fail(fn, HCCL_E_PARA, "unknown communicator %p", comm);
  if (n > 0 && !info) return fail(fn, HCCL_E_PARA, "%u items but no item array", n);
  std::vector<Item> sends, recvs;
  for (uint32_t i = 0; i < n; ++i) {
    const HcclSendRecvItem& x = info[i];
    if (x.sendRecvType != HCCL_SEND && x.sendRecvType != HCCL_RECV)
      return fail(fn, HCCL_E_PARA, "item %u: bad sendRecvType %d", i, static_cast<int>(x.sendRecvType));
    if (x.remoteRank != 1 - c->rank)
      return fail(fn, HCCL_E_PARA, "item %u: remote rank %u is not the peer of rank %u", i, x.remoteRank, c->rank);
    size_t es = dtype_size(x.dataType);
    if (es == 0) return fail(fn, HCCL_E_PARA, "item %u: unsupported data type %d", i, static_cast<int>(x.dataType));
    if (x.count > SIZE_MAX / es) return fail(fn, HCCL_E_PARA, "item %u: count overflows", i);
    size_t bytes = x.count * es;
    fake::DevRange r{};
    if (!H().lookup(x.buf, bytes, &r))
      return fail(fn, HCCL_E_PTR, "item %u: [%p, +%zu) is not live device memory", i, x.buf, bytes);
    (x.sendRecvType == HCCL_SEND ? sends : recvs).push_back({r.shadow, x.count, static_cast<int>(x.dataType), bytes});
  }
  if (sends.empty() && recvs.empty()) return HCCL_SUCCESS;
  int rc = H().enqueue(stream, [c, sends, recvs] { return run_batch(c, sends, recvs); }, fn);
  if (rc) return rc == ACL_ERROR_RT_CONTEXT_NULL ? HCCL_E_RUNTIME : HCCL_E_PARA;
  return HCCL_SUCCESS;
}

// ------------------------------------------------------------------------------- rendezvous

struct RootBlob {  // the start of the 4108-byte HcclRootInfo
  char magic[8];
  uint64_t nonce;
  int32_t pid;
  char name[100];  // abstract socket name
};
static_assert(sizeof(RootBlob) <= HCCL_ROOT_INFO_BYTES, "root blob fits HcclRootInfo");

struct Hello {  // joiner -> root, once per link
  uint32_t magic, channel;
  uint64_t nonce, session;
};

struct Welcome {  // root -> joiner: 0, or why it was refused
  uint32_t magic;
  int32_t status;
};

void close_all(int* fds, int n) {
  for (int i = 0; i < n; ++i)
    if (fds[i] >= 0) close(fds[i]), fds[i] = -1;
}

// Rank 0: accept the two links of one joiner (channel 0: rank 1 -> rank 0, channel 1: the reverse).
HcclResult accept_peer(const RootBlob& b, Clock::time_point deadline, Comm& c) {
  if (b.pid != getpid()) return HCCL_E_PARA;
  Listener l;
  {
    std::lock_guard<std::mutex> lk(reg().mu);
    auto it = reg().listeners.find(b.name);
    if (it == reg().listeners.end() || it->second.nonce != b.nonce) return HCCL_E_PARA;
    l = it->second;
    reg().listeners.erase(it);  // one communicator per root info
  }
  int ch[2] = {-1, -1};
  uint64_t session = 0;
  while ((ch[0] < 0 || ch[1] < 0) && ms_left(deadline) > 0) {
    if (fake::wait_fd(l.fd, POLLIN, ms_left(deadline))) continue;
    int s = accept4(l.fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) continue;
    Hello h{};
    int e = fake::sock_recv(s, &h, sizeof h, std::min(ms_left(deadline), 1000));
    if (e || h.magic != kHelloMagic || h.nonce != l.nonce || h.channel > 1) {
      Welcome w{kWelcomeMagic, HCCL_E_PARA};  // refused: wrong nonce or not one of ours
      fake::sock_send(s, &w, sizeof w, 100);
      close(s);
      continue;
    }
    if (h.session != session) {  // a new joiner (e.g. a retry after a timeout) replaces the old one
      close_all(ch, 2);
      session = h.session;
    }
    if (ch[h.channel] >= 0) close(ch[h.channel]);
    ch[h.channel] = s;
  }
  if (ch[0] < 0 || ch[1] < 0) {
    close_all(ch, 2);
    std::lock_guard<std::mutex> lk(reg().mu);
    reg().listeners[b.name] = l;  // the root info stays usable for another attempt
    return HCCL_E_TIMEOUT;
  }
  close(l.fd);
  Welcome w{kWelcomeMagic, 0};
  for (int fd : ch) {
    if (int e = fake::sock_send(fd, &w, sizeof w, 1000)) {
      close_all(ch, 2);
      return e == ETIMEDOUT ? HCCL_E_TIMEOUT : HCCL_E_TCP_CONNECT;
    }
  }
  c.in_fd = ch[0];
  c.out_fd = ch[1];
  return HCCL_SUCCESS;
}

// Rank 1: connect both links (retrying until rank 0 listens or the deadline passes).
HcclResult connect_root(const RootBlob& b, Clock::time_point deadline, Comm& c) {
  sockaddr_un a;
  socklen_t alen = fake::abstract_addr(b.name, &a);
  uint64_t session = random64() | 1;
  int ch[2] = {-1, -1};
  for (uint32_t i = 0; i < 2; ++i) {
    for (;;) {
      ch[i] = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (ch[i] >= 0 && connect(ch[i], reinterpret_cast<sockaddr*>(&a), alen) == 0) break;
      close(ch[i]);
      ch[i] = -1;
      if (ms_left(deadline) <= 0) {
        close_all(ch, 2);
        return HCCL_E_TIMEOUT;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    Hello h{kHelloMagic, i, b.nonce, session};
    if (int e = fake::sock_send(ch[i], &h, sizeof h, std::max(ms_left(deadline), 1))) {
      close_all(ch, 2);
      return e == ETIMEDOUT ? HCCL_E_TIMEOUT : HCCL_E_TCP_CONNECT;
    }
  }
  for (int fd : ch) {
    Welcome w{};
    int e = fake::sock_recv(fd, &w, sizeof w, ms_left(deadline));
    HcclResult r = e == ETIMEDOUT             ? HCCL_E_TIMEOUT
                   : e                        ? HCCL_E_TCP_CONNECT
                   : w.magic != kWelcomeMagic ? HCCL_E_TCP_CONNECT
                                              : static_cast<HcclResult>(w.status);
    if (r != HCCL_SUCCESS) {
      close_all(ch, 2);
      return r;
    }
  }
  c.out_fd = ch[0];
  c.in_fd = ch[1];
  return HCCL_SUCCESS;
}

// ------------------------------------------------------------------------------- one-sided

struct SegWire {  // one bound segment in a Prepare table
  uint64_t addr, size, file_off, file_size;
  int32_t fd_index, pad;
};

HcclResult one_sided(const char* fn, bool put, HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc* desc, uint32_t n,
                     aclrtStream stream) {
  auto c = find_comm(comm);
  if (!c) return fail(fn, HCCL_E_PARA, "unknown communicator %p", comm);
  if (remoteRank != 1 - c->rank) return fail(fn, HCCL_E_PARA, "remote rank %u is not the peer", remoteRank);
  if (n > 0 && !desc) return fail(fn, HCCL_E_PARA, "%u descriptors but no array", n);
  struct Op {
    char* dst;
    const char* src;
    size_t bytes;
  };
  std::vector<Op> ops;
  std::lock_guard<std::mutex> lk(c->mem_mu);
  for (uint32_t i = 0; i < n; ++i) {
    size_t es = dtype_size(desc[i].dataType);
    if (es == 0 || desc[i].count > SIZE_MAX / es) return fail(fn, HCCL_E_PARA, "desc %u: bad data type or count", i);
    size_t bytes = desc[i].count * es;
    fake::DevRange local{};
    if (!H().lookup(desc[i].localAddr, bytes, &local))
      return fail(fn, HCCL_E_PTR, "desc %u: local [%p, +%zu) is not live device memory", i, desc[i].localAddr, bytes);
    uint64_t ra = reinterpret_cast<uint64_t>(desc[i].remoteAddr);
    char* remote = nullptr;
    for (const RemoteSeg& s : c->remote)
      if (ra >= s.addr && ra + bytes <= s.addr + s.size) remote = s.shadow + (ra - s.addr);
    if (!remote)
      return fail(fn, HCCL_E_PTR, "desc %u: remote [%p, +%zu) is not in a segment the peer prepared", i,
                  desc[i].remoteAddr, bytes);
    ops.push_back(put ? Op{remote, local.shadow, bytes} : Op{local.shadow, remote, bytes});
  }
  if (ops.empty()) return HCCL_SUCCESS;
  // The task holds the communicator, hence the peer mappings, until it has run.
  int rc = H().enqueue(
      stream,
      [c, ops] {
        for (const Op& op : ops) memmove(op.dst, op.src, op.bytes);
        return 0;
      },
      fn);
  if (rc) return rc == ACL_ERROR_RT_CONTEXT_NULL ? HCCL_E_RUNTIME : HCCL_E_PARA;
  return HCCL_SUCCESS;
}

// Sends this side's bound segments (with the arena memfds) and maps the peer's. Both ranks call it.
HcclResult prepare(Comm& c, int tmo) {
  std::vector<SegWire> mine;
  std::vector<int> fds;
  {
    std::lock_guard<std::mutex> lk(c.mem_mu);
    for (auto& kv : c.bound) {
      const fake::DevRange& r = kv.second->range;
      auto pos = std::find(fds.begin(), fds.end(), r.memfd);
      if (pos == fds.end()) {
        if (fds.size() == static_cast<size_t>(fake::kMaxFds)) return HCCL_E_NOT_SUPPORT;
        pos = fds.insert(fds.end(), r.memfd);
      }
      mine.push_back({reinterpret_cast<uint64_t>(kv.second->desc.addr), kv.second->desc.size, r.file_off, r.file_size,
                      static_cast<int32_t>(pos - fds.begin()), 0});
    }
  }
  Frame f{kFrameMagic, kTable, mine.size(), 0, static_cast<int32_t>(fds.size())}, pf{};
  int e = fake::sock_send(c.out_fd, &f, sizeof f, tmo, fds.data(), static_cast<int>(fds.size()));
  if (!e && !mine.empty()) e = fake::sock_send(c.out_fd, mine.data(), mine.size() * sizeof(SegWire), tmo);
  int got[fake::kMaxFds], ngot = 0;
  if (!e) e = fake::sock_recv(c.in_fd, &pf, sizeof pf, tmo, got, fake::kMaxFds, &ngot);
  if (e) return io_result(e);
  HcclResult r = HCCL_SUCCESS;
  std::vector<SegWire> theirs(pf.magic == kFrameMagic && pf.type == kTable && pf.count <= 4096 ? pf.count : 0);
  if (theirs.size() != pf.count)
    r = HCCL_E_TCP_TRANSFER;
  else if (!theirs.empty())
    r = io_result(fake::sock_recv(c.in_fd, theirs.data(), theirs.size() * sizeof(SegWire), tmo));
  std::vector<RemoteSeg> segs;
  std::vector<std::pair<void*, size_t>> maps;
  std::vector<char*> mapped(static_cast<size_t>(ngot), nullptr);
  for (const SegWire& s : theirs) {
    if (r) break;
    if (s.fd_index < 0 || s.fd_index >= ngot) {
      r = HCCL_E_TCP_TRANSFER;
      break;
    }
    char*& m = mapped[static_cast<size_t>(s.fd_index)];
    if (!m) {
      void* p = mmap(nullptr, s.file_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, got[s.fd_index], 0);
      if (p == MAP_FAILED) {
        r = HCCL_E_MEMORY;
        break;
      }
      m = static_cast<char*>(p);
      maps.push_back({p, s.file_size});
    }
    segs.push_back({s.addr, s.size, m + s.file_off});
  }
  for (int i = 0; i < ngot; ++i) close(got[i]);
  if (r) {
    for (auto& mp : maps) munmap(mp.first, mp.second);
    return r;
  }
  std::lock_guard<std::mutex> lk(c.mem_mu);
  c.unmap_peers();
  c.remote = std::move(segs);
  c.maps = std::move(maps);
  return HCCL_SUCCESS;
}

}  // namespace

// ================================================================================ exported API

extern "C" {

HcclResult HcclGetRootInfo(HcclRootInfo* rootInfo) {
  HCCL_BEGIN();
  if (!rootInfo) return fail(__func__, HCCL_E_PARA, "rootInfo is null");
  static std::atomic<int> seq{0};
  RootBlob b{};
  memcpy(b.magic, kRootMagic, sizeof b.magic);
  b.nonce = random64();
  b.pid = getpid();
  snprintf(b.name, sizeof b.name, "pdlink-fake-hccl.%d.%d", b.pid, seq++);
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  sockaddr_un a;
  socklen_t alen = fake::abstract_addr(b.name, &a);
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), alen) != 0 || listen(fd, 16) != 0) {
    int e = errno;
    if (fd >= 0) close(fd);
    return fail(__func__, HCCL_E_TCP_CONNECT, "cannot listen on %s: %s", b.name, strerror(e));
  }
  {
    std::lock_guard<std::mutex> lk(reg().mu);
    reg().listeners[b.name] = {fd, b.nonce};
  }
  memset(rootInfo, 0, sizeof *rootInfo);
  memcpy(rootInfo, &b, sizeof b);
  return HCCL_SUCCESS;
}

HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank, HcclComm* comm) {
  HCCL_BEGIN();
  if (!rootInfo || !comm) return fail(__func__, HCCL_E_PARA, "rootInfo %p, comm %p", rootInfo, comm);
  if (nRanks != 2) return fail(__func__, HCCL_E_NOT_SUPPORT, "the fake models 2 ranks, not %u", nRanks);
  if (rank >= nRanks) return fail(__func__, HCCL_E_PARA, "rank %u >= nRanks %u", rank, nRanks);
  RootBlob b;
  memcpy(&b, rootInfo, sizeof b);
  b.name[sizeof b.name - 1] = 0;
  if (memcmp(b.magic, kRootMagic, sizeof b.magic) != 0)
    return fail(__func__, HCCL_E_PARA, "not a root info from HcclGetRootInfo");
  auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms("HCCL_CONNECT_TIMEOUT"));
  auto c = std::make_shared<Comm>();
  c->rank = rank;
  HcclResult r = rank == 0 ? accept_peer(b, deadline, *c) : connect_root(b, deadline, *c);
  if (r == HCCL_E_PARA && rank == 0)
    return fail(__func__, r, "rank 0 must run in the process that created the root info, which is used once");
  if (r)
    return fail(__func__, r, "rank %u could not join (%s)", rank,
                r == HCCL_E_TIMEOUT ? "HCCL_CONNECT_TIMEOUT expired" : "refused or link error");
  std::lock_guard<std::mutex> lk(reg().mu);
  reg().comms[c.get()] = c;
  *comm = c.get();
  return HCCL_SUCCESS;
}

HcclResult HcclCommDestroy(HcclComm comm) {
  HCCL_BEGIN();
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lk(reg().mu);
    auto it = reg().comms.find(comm);
    if (it == reg().comms.end()) return fail(__func__, HCCL_E_PARA, "unknown communicator %p", comm);
    c = it->second;
    reg().comms.erase(it);
  }
  c->hangup();  // pending tasks wake and fail; the last one to finish frees the communicator
  return HCCL_SUCCESS;
}

HcclResult HcclSend(void* sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank, HcclComm comm,
                    aclrtStream stream) {
  HCCL_BEGIN();
  HcclSendRecvItem it{HCCL_SEND, sendBuf, count, dataType, destRank};
  return submit(__func__, &it, 1, comm, stream);
}

HcclResult HcclRecv(void* recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank, HcclComm comm,
                    aclrtStream stream) {
  HCCL_BEGIN();
  HcclSendRecvItem it{HCCL_RECV, recvBuf, count, dataType, srcRank};
  return submit(__func__, &it, 1, comm, stream);
}

HcclResult HcclBatchSendRecv(HcclSendRecvItem* sendRecvInfo, uint32_t itemNum, HcclComm comm, aclrtStream stream) {
  HCCL_BEGIN();
  return submit(__func__, sendRecvInfo, itemNum, comm, stream);
}

const char* HcclGetErrorString(HcclResult code) {
  H().enter(__func__);
  static const char* const kNames[] = {"HCCL_SUCCESS",
                                       "HCCL_E_PARA",
                                       "HCCL_E_PTR",
                                       "HCCL_E_MEMORY",
                                       "HCCL_E_INTERNAL",
                                       "HCCL_E_NOT_SUPPORT",
                                       "HCCL_E_NOT_FOUND",
                                       "HCCL_E_UNAVAIL",
                                       "HCCL_E_SYSCALL",
                                       "HCCL_E_TIMEOUT",
                                       "HCCL_E_OPEN_FILE_FAILURE",
                                       "HCCL_E_TCP_CONNECT",
                                       "HCCL_E_ROCE_CONNECT",
                                       "HCCL_E_TCP_TRANSFER",
                                       "HCCL_E_ROCE_TRANSFER",
                                       "HCCL_E_RUNTIME",
                                       "HCCL_E_DRV",
                                       "HCCL_E_PROFILING",
                                       "HCCL_E_CCE",
                                       "HCCL_E_NETWORK",
                                       "HCCL_E_AGAIN",
                                       "HCCL_E_REMOTE",
                                       "HCCL_E_SUSPENDING",
                                       "HCCL_E_OPRETRY_FAIL",
                                       "HCCL_E_OOM"};
  int i = static_cast<int>(code);
  return i >= 0 && i < static_cast<int>(sizeof kNames / sizeof kNames[0]) ? kNames[i] : "HCCL_E_UNKNOWN";
}

HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult* asyncError) {
  HCCL_BEGIN();
  auto c = find_comm(comm);
  if (!c || !asyncError) return fail(__func__, HCCL_E_PARA, "comm %p, asyncError %p", comm, asyncError);
  *asyncError = static_cast<HcclResult>(c->async_err.load());
  return HCCL_SUCCESS;
}

HcclResult HcclRegisterGlobalMem(const CommMem* mem, void** memHandle) {
  HCCL_BEGIN();
  if (!mem || !memHandle) return fail(__func__, HCCL_E_PARA, "mem %p, memHandle %p", mem, memHandle);
  if (mem->type != COMM_MEM_TYPE_DEVICE) return fail(__func__, HCCL_E_NOT_SUPPORT, "only device memory is modelled");
  auto m = std::make_shared<Mem>();
  m->desc = *mem;
  if (!H().lookup(mem->addr, mem->size, &m->range))
    return fail(__func__, HCCL_E_PTR, "[%p, +%llu) is not live device memory", mem->addr,
                static_cast<unsigned long long>(mem->size));
  std::lock_guard<std::mutex> lk(reg().mu);
  reg().mems[m.get()] = m;
  *memHandle = m.get();
  return HCCL_SUCCESS;
}

HcclResult HcclDeregisterGlobalMem(void* memHandle) {
  HCCL_BEGIN();
  std::lock_guard<std::mutex> lk(reg().mu);
  if (!reg().mems.erase(memHandle)) return fail(__func__, HCCL_E_PARA, "unknown memory handle %p", memHandle);
  return HCCL_SUCCESS;
}

HcclResult HcclCommBindMem(HcclComm comm, void* memHandle) {
  HCCL_BEGIN();
  auto c = find_comm(comm);
  std::shared_ptr<Mem> m;
  {
    std::lock_guard<std::mutex> lk(reg().mu);
    auto it = reg().mems.find(memHandle);
    if (it != reg().mems.end()) m = it->second;
  }
  if (!c || !m) return fail(__func__, HCCL_E_PARA, "comm %p, memHandle %p", comm, memHandle);
  std::lock_guard<std::mutex> lk(c->mem_mu);
  c->bound[memHandle] = m;
  return HCCL_SUCCESS;
}

HcclResult HcclCommUnbindMem(HcclComm comm, void* memHandle) {
  HCCL_BEGIN();
  auto c = find_comm(comm);
  if (!c) return fail(__func__, HCCL_E_PARA, "unknown communicator %p", comm);
  std::lock_guard<std::mutex> lk(c->mem_mu);
  if (!c->bound.erase(memHandle)) return fail(__func__, HCCL_E_PARA, "%p is not bound to this communicator", memHandle);
  return HCCL_SUCCESS;
}

HcclResult HcclCommPrepare(HcclComm comm, const HcclPrepareConfig* /*config: full mesh only*/, int32_t timeoutSec) {
  HCCL_BEGIN();
  auto c = find_comm(comm);
  if (!c) return fail(__func__, HCCL_E_PARA, "unknown communicator %p", comm);
  if (c->broken) return fail(__func__, HCCL_E_TCP_TRANSFER, "the communicator is broken");
  int tmo = timeoutSec > 0 ? timeoutSec * 1000 : timeout_ms("HCCL_CONNECT_TIMEOUT");
  std::scoped_lock lk(c->out_mu, c->in_mu);
  HcclResult r = prepare(*c, tmo);
  if (r) {
    c->fail(r);  // the table exchange is half done: the links are out of step for good
    return fail(__func__, r, "segment exchange with the peer failed");
  }
  return HCCL_SUCCESS;
}

HcclResult HcclBatchPut(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc* desc, uint32_t descNum,
                        aclrtStream stream) {
  HCCL_BEGIN();
  return one_sided(__func__, true, comm, remoteRank, desc, descNum, stream);
}

HcclResult HcclBatchGet(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc* desc, uint32_t descNum,
                        aclrtStream stream) {
  HCCL_BEGIN();
  return one_sided(__func__, false, comm, remoteRank, desc, descNum, stream);
}

}  // extern "C"
