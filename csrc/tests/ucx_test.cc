// The UCX building blocks (transport/ucx/ucx_worker.h) against the real libucp, in one process.
//
// Usage: ucx_test            (UCX_TLS as the environment sets it; CI runs it with tcp and sm,tcp)
// Needs libucp (PDLINK_UCX_LIB_DIR, the loader path). Without it the program prints why and exits
// 0, unless PDLINK_REQUIRE_UCX=1 (CI's ucx job), where that is a failure.
// Checks:
//   - transportsFor: what a network-only worker may use, for each form of UCX_TLS; the rule by
//     which `auto` picks ucx between hosts (autoFamilies, anyLaneOf);
//   - the lanes an endpoint reports (UcxEndpoint::lanes): never shared memory on a network
//     worker, shared memory on an any-transport one under sm,tcp;
//   - per scope (network-only, any transport): two workers, A and B, B's progressed from a thread
//     that sleeps on its event fd as a serving side does. A sends Active Messages whose header
//     names an offset in B's guarded buffer; B's handler receives each into that range. A small
//     message, a 4 KiB one and a 1 MiB one (which arrives by rendezvous) land exactly: the whole
//     buffer is the old bytes with exactly those ranges replaced, the guards intact. A message
//     that would run past the buffer is dropped by the handler: nothing changes;
//   - why pdlink's workers have no UCP_FEATURE_RMA (docs/ucx.md, "Trust"), over tcp and sm,tcp: a
//     probe with RMA enabled writes through a remote key of another RMA-enabled context to memory
//     outside every mapped range, and it lands; the same write aimed at worker B lands nowhere
//     (B drops the emulated put) and fails by its deadline;
//   - why the ucx transport needs ucx_trusted_network: in a child process, UCX's own ucp_ep_create
//     on worker addresses of random bytes (what a hostile peer could send): UCX aborts the process;
//   - and why pdlink checks every address first (checkWorkerAddress): this UCX's own addresses
//     pass (v1, v2 and with debug info); one byte short, one byte more, another version, an empty one are refused, and
//     so are every random address (the child lives) and built ones UCX would misread (a transport this side has without
//     its device or interface address, md index 64, 0 paths, a bandwidth that is not a number, endpoint addresses, 129
//     transports, no devices, a v2 active-message segment of 64 bytes); of 600 mutants of a real address, UCX takes the
//     ones the check lets through without dying (a child process), per scope;
//   - B's worker destroyed: A's next send returns by its deadline; on a network worker's endpoint
//     (which asks UCX to report a peer's death) it fails, kLinkFailed or kTimeout;
//   - with shared memory alone (UCX_TLS=sm): a network worker cannot be made; the any-transport
//     worker moves the same messages.
// Exit status 0 when every check passed, 1 otherwise (the failures are printed).
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/ucx/ucx_worker.h"
#include "test_engines.h"

using namespace pdlink;
using namespace pdlink::ucx;
using testing::check;
using testing::checkCode;

namespace {

constexpr size_t kGuard = 64;
constexpr size_t kBytes = 4 << 20;
constexpr unsigned kPlaceId = 1;  // A's messages: header = the offset in B's buffer

// kBytes of `seed`-derived data with kGuard pattern bytes on either side.
struct Guarded {
  std::vector<uint8_t> all;
  explicit Guarded(uint8_t seed) : all(kBytes + 2 * kGuard) {
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 11));
    for (size_t i = 0; i < kGuard; ++i) all[i] = all[all.size() - 1 - i] = 0xA5;
  }
  uint8_t* data() { return all.data() + kGuard; }
};

struct Piece {
  uint64_t src;  // offset in A's buffer
  uint64_t dst;  // offset in B's buffer
  uint64_t length;
};

// Every byte of `after` equals `before` but the pieces, which are `src`'s.
void checkExact(const Guarded& before, const Guarded& after, const Guarded& src, const std::vector<Piece>& pieces,
                const std::string& what) {
  std::vector<uint8_t> want = before.all;
  for (const Piece& p : pieces) std::memcpy(want.data() + kGuard + p.dst, src.all.data() + kGuard + p.src, p.length);
  size_t wrong = 0;
  for (size_t i = 0; i < want.size(); ++i) wrong += want[i] != after.all[i];
  check(wrong == 0, what + ": " + std::to_string(wrong) + " bytes differ from the expected buffer");
}

bool pollUntil(const std::function<bool()>& done, int timeout_ms) {
  Deadline deadline = Deadline::afterMs(timeout_ms);
  while (!done()) {
    if (deadline.expired()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

void testTransportsFor() {
  auto is = [](Result<std::string> r, const std::string& want, const std::string& what) {
    check(r.ok() && r.value() == want, what + ": got " + (r.ok() ? r.value() : r.status().message()));
  };
  is(transportsFor(WorkerScope::kNetwork, nullptr), "^sm,self", "unset");
  is(transportsFor(WorkerScope::kNetwork, "all"), "^sm,self", "all");
  is(transportsFor(WorkerScope::kNetwork, "sm,tcp"), "tcp", "sm,tcp");
  is(transportsFor(WorkerScope::kNetwork, "posix,cma,self,rc,tcp"), "rc,tcp", "members of sm");
  is(transportsFor(WorkerScope::kNetwork, "^ud"), "^ud,sm,self", "an exclusion");
  is(transportsFor(WorkerScope::kNetwork, "^sm"), "^sm,self", "an exclusion naming sm");
  is(transportsFor(WorkerScope::kAny, "sm,tcp"), "sm,tcp", "any scope keeps it");
  checkCode(transportsFor(WorkerScope::kNetwork, "sm,self").status(), Code::kFeatureNotEnabled,
            "only local transports");
}

void testAutoChoice() {
  check(transportFamily("rc_mlx5/mlx5_0:1") == "rc" && transportFamily("tcp/eth0") == "tcp" &&
            transportFamily("dc") == "dc",
        "transportFamily");
  check(autoFamilies(nullptr) == std::vector<std::string>{"rc", "dc", "ud", "srd"}, "autoFamilies: the RDMA default");
  check(autoFamilies("tcp,rc_x") == std::vector<std::string>{"tcp", "rc"}, "autoFamilies: a list");
  check(autoFamilies("").empty(), "autoFamilies: empty names none");
  check(anyLaneOf({"tcp/eth0", "rc_mlx5/mlx5_0:1"}, autoFamilies(nullptr)), "anyLaneOf: an rc lane");
  check(!anyLaneOf({"tcp/eth0", "tcp/lo"}, autoFamilies(nullptr)), "anyLaneOf: tcp alone is not RDMA");
  check(!anyLaneOf({}, autoFamilies(nullptr)), "anyLaneOf: no lanes");
}

// The lanes UCX reports for an endpoint between two workers of this process: a network worker's
// are never shared memory; with UCX_TLS=tcp they are all tcp; an any-transport worker under
// sm,tcp moves through shared memory (some lane of posix, sysv, cma, knem or xpmem).
void checkLanes(const std::vector<std::string>& lanes, WorkerScope scope, const char* tls, const std::string& name) {
  std::string all;
  for (const std::string& l : lanes) all += l + " ";
  std::printf("  %s: lanes %s\n", name.c_str(), all.c_str());
  check(!lanes.empty(), name + ": the endpoint names its lanes");
  const std::vector<std::string> shm = {"posix", "sysv", "cma", "knem", "xpmem", "self"};
  if (scope == WorkerScope::kNetwork) check(!anyLaneOf(lanes, shm), name + ": no shared-memory lane: " + all);
  const std::string setting = tls ? tls : "";
  if (setting == "tcp") check(anyLaneOf(lanes, {"tcp"}) && !anyLaneOf(lanes, shm), name + ": tcp lanes: " + all);
  if (setting == "sm,tcp" && scope == WorkerScope::kAny)
    check(anyLaneOf(lanes, shm), name + ": a shared-memory lane: " + all);
}

// Progresses `w` whenever its event fd says so, until `stop`.
void serveLoop(UcxWorker* w, std::atomic<bool>* stop) {
  while (!stop->load()) {
    w->progress();
    if (!w->arm()) continue;  // events arrived meanwhile
    pollfd p{w->eventFd(), POLLIN, 0};
    ::poll(&p, 1, 50);
  }
}

// A raw UCP context and worker with UCP_FEATURE_RMA and the user's UCX_TLS: what pdlink does not
// make, to show what it would expose.
struct RmaContext {
  const UcpApi* api;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::string address;
  explicit RmaContext(const UcpApi* a) : api(a) {
    ucp_config_t* config = nullptr;
    api->ucp_config_read(nullptr, nullptr, &config);
    Params params;
    params.field_mask = kParamFieldFeatures;
    params.features = kFeatureRma;
    ucs_status_t st = api->ucp_init_version(kApiMajor, kApiMinor, &params, config, &context);
    api->ucp_config_release(config);
    if (st != kOk) return;
    WorkerParams wp;
    wp.field_mask = kWorkerParamFieldThreadMode;
    wp.thread_mode = kThreadModeMulti;
    if (api->ucp_worker_create(context, &wp, &worker) != kOk) return;
    WorkerAttr attr;
    attr.field_mask = kWorkerAttrFieldAddress;
    if (api->ucp_worker_query(worker, &attr) != kOk) return;
    address.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
    api->ucp_worker_release_address(worker, attr.address);
  }
  ~RmaContext() {
    if (worker) api->ucp_worker_destroy(worker);
    if (context) api->ucp_cleanup(context);
  }
  bool ok() const { return !address.empty(); }
};

// The probe `from` puts 64 bytes at `target` of the process reached through `peer_address`, with
// the remote key `packed_key`; whether the put and its flush completed by the deadline.
bool probePut(RmaContext& from, const std::string& peer_address, const std::string& packed_key, uint8_t* target,
              const std::function<void()>& progress_peer) {
  const UcpApi* api = from.api;
  EpParams ep_params;
  ep_params.field_mask = kEpParamFieldRemoteAddress | kEpParamFieldErrHandlingMode;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  ep_params.err_mode = kErrHandlingModePeer;
  ucp_ep_h ep = nullptr;
  if (api->ucp_ep_create(from.worker, &ep_params, &ep) != kOk) return false;
  ucp_rkey_h rkey = nullptr;
  bool completed = false;
  if (api->ucp_ep_rkey_unpack(ep, packed_key.data(), &rkey) == kOk) {
    std::vector<uint8_t> payload(64, 0x5C);
    RequestParam param;
    std::vector<ucs_status_ptr_t> reqs;
    reqs.push_back(
        api->ucp_put_nbx(ep, payload.data(), payload.size(), reinterpret_cast<uint64_t>(target), rkey, &param));
    reqs.push_back(api->ucp_ep_flush_nbx(ep, &param));
    Deadline deadline = Deadline::afterMs(1500);
    completed = true;
    for (ucs_status_ptr_t r : reqs) {
      if (ptrIsErr(r)) completed = false;
      if (!ptrIsPtr(r)) continue;
      while (api->ucp_request_check_status(r) == kInProgress && !deadline.expired()) {
        api->ucp_worker_progress(from.worker);
        progress_peer();
      }
      completed = completed && api->ucp_request_check_status(r) == kOk;
    }
    api->ucp_rkey_destroy(rkey);
    RequestParam close;
    close.op_attr_mask = kOpAttrFieldFlags;
    close.flags = kEpCloseFlagForce;
    ucs_status_ptr_t c = api->ucp_ep_close_nbx(ep, &close);
    for (ucs_status_ptr_t r : reqs) {
      if (!ptrIsPtr(r)) continue;
      while (api->ucp_request_check_status(r) == kInProgress) api->ucp_worker_progress(from.worker);
      api->ucp_request_free(r);
    }
    if (ptrIsPtr(c)) {
      while (api->ucp_request_check_status(c) == kInProgress) api->ucp_worker_progress(from.worker);
      api->ucp_request_free(c);
    }
  }
  return completed;
}

void testWhyNoRma(const UcpApi* api, UcxWorker& b, Guarded& b_buffer, const char* tls) {
  RmaContext probe(api), other(api);
  check(probe.ok() && other.ok(), "RMA contexts for the probe");
  if (!probe.ok() || !other.ok()) return;
  // `other` maps 4 KiB and packs a key; the probe then writes through it outside that range.
  std::vector<uint8_t> mapped(4096), outside(4096, 0x11);
  MemMapParams mp;
  mp.field_mask = kMemMapParamFieldAddress | kMemMapParamFieldLength | kMemMapParamFieldProt;
  mp.address = mapped.data();
  mp.length = mapped.size();
  mp.prot = kProtLocalRead | kProtLocalWrite | kProtRemoteRead;  // not even remote-writable
  ucp_mem_h memh = nullptr;
  void* packed = nullptr;
  size_t packed_size = 0;
  if (api->ucp_mem_map(other.context, &mp, &memh) != kOk ||
      api->ucp_rkey_pack(other.context, memh, &packed, &packed_size) != kOk) {
    check(false, "mapping memory in the RMA context");
    return;
  }
  std::string key(static_cast<const char*>(packed), packed_size);
  api->ucp_rkey_buffer_release(packed);
  bool asserted = tls != nullptr && (std::string(tls) == "tcp" || std::string(tls) == "sm,tcp");

  std::vector<uint8_t> outside0 = outside;
  bool done =
      probePut(probe, other.address, key, outside.data() + 100, [&] { api->ucp_worker_progress(other.worker); });
  bool landed = done && outside != outside0;
  std::printf("  an RMA-enabled context: a put outside its mapped range, through a read-only key: %s\n",
              landed ? "landed" : "did not land");
  if (asserted) check(landed, "a put outside the mapped range landed in an RMA-enabled context (UCX changed?)");

  // The same put aimed at pdlink's worker B, with the same key: dropped, and B's bytes stay.
  Guarded before = b_buffer;
  done = probePut(probe, b.address(), key, b_buffer.data() + 100, [&] { b.progress(); });
  std::printf("  pdlink's worker: the same put: %s\n", done ? "completed" : "failed by its deadline");
  checkExact(before, b_buffer, before, {}, "pdlink's worker after a peer's emulated put");
  if (asserted) check(!done, "pdlink's worker completed a peer's emulated put");
  api->ucp_mem_unmap(other.context, memh);
}

void testMoves(const UcpApi* api, WorkerScope scope) {
  const std::string name = scope == WorkerScope::kNetwork ? "network worker" : "any-transport worker";
  const char* tls = std::getenv("UCX_TLS");
  if (scope == WorkerScope::kNetwork && !transportsFor(scope, tls).ok()) {
    checkCode(UcxWorker::open(scope).status(), Code::kFeatureNotEnabled, name + " with no network transport");
    return;
  }
  Result<std::unique_ptr<UcxWorker>> a = UcxWorker::open(scope);
  Result<std::unique_ptr<UcxWorker>> b = UcxWorker::open(scope);
  if (!a.ok() || !b.ok()) {
    check(false, name + ": open: " + (a.ok() ? b.status().message() : a.status().message()));
    return;
  }
  std::printf("  %s: UCX_TLS=%s, address %zu bytes\n", name.c_str(), a.value()->transports().c_str(),
              a.value()->address().size());
  Guarded source(1), sink(2);
  std::mutex mu;
  int received = 0, refused = 0, rendezvous = 0;
  std::vector<std::string> errors;
  Status st = b.value()->setHandler(kPlaceId, [&](AmIncoming& in) {
    uint64_t offset = 0;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (in.header_length != sizeof(offset)) {
        ++refused;
        return;
      }
      std::memcpy(&offset, in.header, sizeof(offset));
      if (offset > kBytes || in.length > kBytes - offset) {  // past the buffer: dropped
        ++refused;
        return;
      }
      rendezvous += in.rendezvous;
    }
    in.receiveInto(sink.data() + offset, [&](Status done) {
      std::lock_guard<std::mutex> inner(mu);
      if (done.ok()) {
        ++received;
      } else {
        errors.push_back(done.message());
      }
    });
  });
  check(st.ok(), name + ": setHandler: " + st.message());

  std::atomic<bool> stop{false};
  std::thread server(serveLoop, b.value().get(), &stop);
  auto ep = a.value()->connect(b.value()->address());
  check(ep.ok(), name + ": connect: " + (ep.ok() ? "" : ep.status().message()));
  if (ep.ok()) checkLanes(ep.value()->lanes(), scope, tls, name);
  if (ep.ok()) {
    // a small, a page-sized and a large piece, out of order, none aligned
    std::vector<Piece> pieces = {{100, 9000, 77}, {40000, 5, 4096}, {3, 2000001, 1 << 20}};
    Guarded sink0 = sink, source0 = source;
    for (const Piece& p : pieces) {
      uint64_t header = p.dst;
      st = ep.value()->send(kPlaceId, &header, sizeof(header), source.data() + p.src, p.length,
                            Deadline::afterMs(10000));
      check(st.ok(), name + ": send " + std::to_string(p.length) + " bytes: " + st.message());
    }
    bool all = pollUntil(
        [&] {
          std::lock_guard<std::mutex> l(mu);
          return received + static_cast<int>(errors.size()) == 3;
        },
        10000);
    check(all && errors.empty(), name + ": three messages received" + (errors.empty() ? "" : ": " + errors[0]));
    {
      std::lock_guard<std::mutex> l(mu);
      check(rendezvous >= 1, name + ": the 1 MiB message came by rendezvous");
    }
    checkExact(sink0, sink, source0, pieces, name + ": the receiver's buffer");
    checkExact(source0, source, source0, {}, name + ": the sender's buffer unchanged");

    // past the receiver's buffer: dropped, nothing lands
    sink0 = sink;
    uint64_t header = kBytes - 100;
    st = ep.value()->send(kPlaceId, &header, sizeof(header), source.data(), 4096, Deadline::afterMs(10000));
    bool dropped = pollUntil(
        [&] {
          std::lock_guard<std::mutex> l(mu);
          return refused == 1;
        },
        10000);
    check(dropped, name + ": a message past the buffer was refused by the handler");
    checkExact(sink0, sink, sink0, {}, name + ": after a message past the buffer");
  }
  stop = true;
  b.value()->signal();
  server.join();

  if (scope == WorkerScope::kAny) testWhyNoRma(api, *b.value(), sink, tls);

  // The peer goes away: the next send fails by its deadline, with a link or timeout code.
  b.value().reset();
  if (ep.ok()) {
    std::vector<uint8_t> small(4096, 7);
    auto t0 = std::chrono::steady_clock::now();
    uint64_t header = 0;
    st = ep.value()->send(kPlaceId, &header, sizeof(header), small.data(), small.size(), Deadline::afterMs(2000));
    if (st.ok()) {  // a small message may complete locally: the next one meets the failure
      st = ep.value()->send(kPlaceId, &header, sizeof(header), small.data(), small.size(), Deadline::afterMs(2000));
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (scope == WorkerScope::kNetwork) {  // endpoints that ask UCX to report a peer's death
      check(st.code() == Code::kLinkFailed || st.code() == Code::kTimeout,
            name + ": a send to a destroyed worker: expected LINK_FAILED or TIMEOUT, got " + st.message());
    } else {
      // Same-host endpoints do not ask (shared memory cannot tell): a small send may complete into
      // the dead peer's queue. pdlink's control link is what reports the peer's death there.
      std::printf("  %s: a send to a destroyed worker: %s\n", name.c_str(),
                  st.ok() ? "completed" : st.message().c_str());
    }
    check(s < 10.0, name + ": a send to a destroyed worker returned after " + std::to_string(s) + " s");
  }
}

// Worker addresses of random bytes, `rounds` of each of several lengths (xorshift from `seed`).
std::vector<std::string> randomAddresses(uint64_t seed, int rounds) {
  std::vector<std::string> out;
  uint64_t x = seed;
  for (size_t length : {1, 2, 8, 16, 64, 77, 100, 184, 213, 1000, 4096}) {
    for (int round = 0; round < rounds; ++round) {
      std::string address(length, '\0');
      for (char& c : address) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        c = static_cast<char>(x);
      }
      out.push_back(address);
    }
  }
  return out;
}

// Moves this process into a network namespace of its own with only loopback up, so that the
// addresses UCX is handed below (mutants and random bytes, which may name any IP) reach nothing
// beyond this machine: a connect to anything but 127.0.0.0/8 fails at once (no route). Needs root
// (CAP_SYS_ADMIN); false and *why otherwise.
bool enterPrivateNetwork(std::string* why) {
  if (::unshare(CLONE_NEWNET) != 0) {
    *why = std::string("unshare(CLONE_NEWNET): ") + std::strerror(errno);
    return false;
  }
  int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  bool up = fd >= 0 && ::ioctl(fd, SIOCGIFFLAGS, &ifr) == 0;
  ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
  up = up && ::ioctl(fd, SIOCSIFFLAGS, &ifr) == 0;
  if (!up) *why = std::string("bringing lo up: ") + std::strerror(errno);
  if (fd >= 0) ::close(fd);
  return up;
}

// Whether children can have a private network (probed once, in a child); *why when not.
bool privateNetworkWorks(std::string* why) {
  int pipefd[2];
  if (::pipe(pipefd) != 0) return false;
  pid_t child = ::fork();
  if (child == 0) {
    ::close(pipefd[0]);
    std::string reason;
    bool ok = enterPrivateNetwork(&reason);
    if (!ok) (void)!::write(pipefd[1], reason.data(), reason.size());
    ::_exit(ok ? 0 : 1);
  }
  ::close(pipefd[1]);
  char buf[256];
  ssize_t n = ::read(pipefd[0], buf, sizeof buf);
  ::close(pipefd[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (n > 0) *why = std::string(buf, static_cast<size_t>(n));
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

// Runs `body` in a child process (120 s at most) in a private network (enterPrivateNetwork; the
// caller has checked privateNetworkWorks); how it ended, and whether by a signal.
bool inChild(const std::function<int()>& body, std::string* how) {
  pid_t child = ::fork();
  if (child == 0) {
    ::alarm(120);  // a child that neither dies nor finishes is not left behind
    std::string why;
    if (!enterPrivateNetwork(&why)) ::_exit(5);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  *how = WIFSIGNALED(status) ? "the process died by signal " + std::to_string(WTERMSIG(status))
                             : "the process exited " + std::to_string(WEXITSTATUS(status));
  return WIFSIGNALED(status);
}

// In a child process, UCX's own ucp_ep_create (no pdlink check) on worker addresses of random bytes
// of several lengths; whether the child died by a signal (UCX aborting on an address it cannot parse).
bool garbageAddressKillsTheProcess(const UcpApi* api) {
  std::string how;
  bool died = inChild(
      [api] {
        RmaContext raw(api);  // a bare UCP worker: what UCX does with the bytes by itself
        if (!raw.ok()) return 2;
        for (const std::string& address : randomAddresses(88172645463325252ull, 8)) {
          EpParams params;
          params.field_mask = kEpParamFieldRemoteAddress;
          params.address = reinterpret_cast<const ucp_address_t*>(address.data());
          ucp_ep_h ep = nullptr;
          (void)api->ucp_ep_create(raw.worker, &params, &ep);  // an endpoint made anyway is left to the exit
        }
        return 0;
      },
      &how);
  std::printf("  UCX's ucp_ep_create on random worker addresses: %s\n", how.c_str());
  return died;
}

// A worker address of UCX's v1 layout (ucx_worker.h), for the refusals UCX would not make itself.
struct AddressBuilder {
  std::string out;
  AddressBuilder() { out = std::string("\x20", 1) + std::string(8, '\x42'); }  // v1, uuid flag; the uuid
  // A device with `entries` transports of checksum `csum` (each with a 2-byte interface address).
  AddressBuilder& device(uint8_t md, uint8_t dev_len_byte, const std::string& dev_addr, uint16_t csum, int entries,
                         float bandwidth = 1e9f, uint8_t iface_len = 2) {
    out += static_cast<char>(md);
    out += static_cast<char>(dev_len_byte);
    if (dev_len_byte & 0x40) out += '\x01';  // one path
    out += dev_addr;
    for (int i = 0; i < entries; ++i) {
      out += static_cast<char>(csum & 0xff);
      out += static_cast<char>(csum >> 8);
      char attr[16] = {};
      std::memcpy(attr + 4, &bandwidth, 4);
      out.append(attr, 16);
      out += static_cast<char>((i + 1 == entries ? 0x80 : 0) | iface_len);
      out.append(iface_len, '\x07');
    }
    return *this;
  }
  std::string end(uint8_t release = 6) { return out + static_cast<char>(0x80 | release) + '\x80'; }
};

// checkWorkerAddress (ucx_worker.h): this UCX's own addresses pass in every form UCX makes; what
// UCX would misread is refused; UcxWorker::connect refuses random bytes (the process lives), and
// among mutants of a real address, those it accepts UCX takes without dying.
void testAddressCheck(const UcpApi* api) {
  // The mutants run in a child with a private network, where a connect to anything but loopback
  // fails at once; should UCX still wait on some (a loopback port that never answers), the child
  // stops after kMutants or kMutantSeconds, whichever comes first, well inside its 120 s alarm,
  // and must have handed UCX at least kMinMutants.
  constexpr int kMutants = 600;
  constexpr int kMinMutants = 100;
  constexpr auto kMutantSeconds = std::chrono::seconds(60);
  const unsigned minor = api->minor;
  for (WorkerScope scope : {WorkerScope::kNetwork, WorkerScope::kAny}) {
    Result<std::unique_ptr<UcxWorker>> w = UcxWorker::open(scope);
    if (!w.ok()) continue;  // UCX_TLS=sm: no network worker (testMoves checks why)
    const std::string name = scope == WorkerScope::kNetwork ? "network" : "any-transport";
    const std::string& a = w.value()->address();
    Result<WorkerAddressLayout> own = parseWorkerAddress(reinterpret_cast<const uint8_t*>(a.data()), a.size(), minor);
    check(own.ok() && !own.value().entries.empty(),
          name + ": this UCX's own address parses: " + (own.ok() ? "" : own.status().message()));
    if (!own.ok()) continue;
    std::printf("  %s worker address: %zu bytes, v%u, %zu devices, %zu transports\n", name.c_str(), a.size(),
                own.value().version + 1, own.value().devices, own.value().entries.size());
    check(w.value()->lanesToSelf().ok(), name + ": an endpoint to its own (checked) address");
    auto refused = [&](const std::string& bad, const std::string& what) {
      Status st = checkWorkerAddress(reinterpret_cast<const uint8_t*>(bad.data()), bad.size(), minor, own.value());
      checkCode(st, Code::kParamInvalid, name + ": " + what);
      checkCode(w.value()->connect(bad).status(), Code::kParamInvalid, name + ": connect refuses " + what);
    };
    refused(a.substr(0, a.size() - 1), "the address one byte short");
    refused(a + '\0', "the address and one byte more");
    refused(std::string(1, static_cast<char>((a[0] & 0xf0) | 2)) + a.substr(1), "address version 3");
    refused("", "an empty address");
    // Mutants of the real address: whatever the check lets through, UCX survives (in a child).
    // Workers are made in the child: UCX's threads do not cross fork().
    std::string how;
    bool died = inChild(
        [&] {
          Result<std::unique_ptr<UcxWorker>> fresh = UcxWorker::open(scope);
          if (!fresh.ok()) return 2;
          uint64_t x = 0x9E3779B97F4A7C15ull;
          auto next = [&x] { return x ^= x << 13, x ^= x >> 7, x ^= x << 17; };
          int ok = 0, tried = 0;
          const auto stop = std::chrono::steady_clock::now() + kMutantSeconds;
          for (; tried < kMutants && std::chrono::steady_clock::now() < stop; ++tried) {
            std::string m = a;
            for (int k = 1 + next() % 3; k > 0; --k) {
              size_t at = next() % m.size();
              switch (next() % 5) {
                case 0:
                  m[at] = static_cast<char>(next());
                  break;
                case 1:
                  m[at] ^= static_cast<char>(1u << (next() % 8));
                  break;
                case 2:
                  m.resize(at + 1);
                  break;
                case 3:
                  m.insert(m.begin() + at, static_cast<char>(next()));
                  break;
                default:
                  if (m.size() > 1) m.erase(m.begin() + at);
                  break;
              }
            }
            Result<std::unique_ptr<UcxEndpoint>> ep = fresh.value()->connect(m);
            ok += ep.ok() || ep.status().code() != Code::kParamInvalid;  // UCX took it (and may have failed)
          }
          std::printf("  %s: of %d mutants of its address, UCX was handed %d\n", name.c_str(), tried, ok);
          std::fflush(stdout);
          return tried >= kMinMutants ? 0 : 4;
        },
        &how);
    // exit 4: fewer than kMinMutants handed over in the time; 2: no worker in the child
    check(!died && how == "the process exited 0", name + ": UCX on the mutants the check let through: " + how);
    died = inChild(
        [&] {
          Result<std::unique_ptr<UcxWorker>> fresh = UcxWorker::open(scope);
          if (!fresh.ok()) return 2;
          for (const std::string& r : randomAddresses(88172645463325252ull, 8)) {
            if (fresh.value()->connect(r).status().code() != Code::kParamInvalid) return 3;
          }
          return 0;
        },
        &how);
    check(!died && how == "the process exited 0", name + ": connect refuses every random address: " + how);
  }
  // The other forms UCX makes of an address (read from the environment when a worker is made):
  // v2, and debug info (the worker's name); each this side's check reads, and connects to.
  for (const char* setting : {"UCX_ADDRESS_VERSION=v2", "UCX_ADDRESS_DEBUG_INFO=y"}) {
    const std::string kv = setting;
    const std::string name = kv.substr(0, kv.find('='));
    ::setenv(name.c_str(), kv.substr(kv.find('=') + 1).c_str(), 1);
    for (WorkerScope scope : {WorkerScope::kNetwork, WorkerScope::kAny}) {
      Result<std::unique_ptr<UcxWorker>> w = UcxWorker::open(scope);
      if (!w.ok() && w.status().code() == Code::kFeatureNotEnabled &&
          w.status().message().find("worker address") == std::string::npos) {
        continue;  // no network worker under this UCX_TLS
      }
      check(w.ok() && w.value()->lanesToSelf().ok(),
            kv + ": a worker opens and connects to its own address: " + (w.ok() ? "" : w.status().message()));
    }
    ::unsetenv(name.c_str());
  }
  // Refusals of the layout itself (pure; the tcp checksum as a transport this side has).
  Result<std::unique_ptr<UcxWorker>> w = UcxWorker::open(WorkerScope::kNetwork);
  if (!w.ok()) return;
  const WorkerAddressLayout& own = w.value()->ownLayout();
  const uint16_t csum = own.entries.front().tl_name_csum;
  auto verdict = [&](const std::string& a) {
    return checkWorkerAddress(reinterpret_cast<const uint8_t*>(a.data()), a.size(), minor, own);
  };
  const std::string dev6("\x00\x02\x7f\x00\x00\x01", 6);
  checkCode(verdict(AddressBuilder().device(0, 6, dev6, csum, 1).end()), Code::kSuccess, "address: a built one passes");
  checkCode(verdict(AddressBuilder().device(0, 0x46, dev6, csum, 1).end()), Code::kSuccess,
            "address: with a paths byte");
  checkCode(verdict(AddressBuilder().device(0, 0, "", csum, 1).end()), Code::kParamInvalid,
            "address: a transport this side has, without its device address");
  checkCode(verdict(AddressBuilder().device(0, 6, dev6, csum, 1, 1e9f, 0).end()), Code::kParamInvalid,
            "address: a transport this side has, without its interface address");
  checkCode(verdict(AddressBuilder().device(0, 0, "", 0x1234, 1).end()), Code::kSuccess,
            "address: a transport this side lacks, as it is (UCX never matches it)");
  checkCode(verdict(AddressBuilder().device(0x40, 6, dev6, csum, 1).end()), Code::kParamInvalid,
            "address: md index 64");
  check(verdict(AddressBuilder().device(0x40, 6, dev6, csum, 1).end(2)).ok() == (minor >= 19),
        "address: bits 5-6 of a 1.18 sender's md index are cleared by UCX 1.19 on");
  std::string zero_paths = AddressBuilder().device(0, 0x46, dev6, csum, 1).end();
  zero_paths[11] = '\0';
  checkCode(verdict(zero_paths), Code::kParamInvalid, "address: 0 paths");
  checkCode(verdict(AddressBuilder().device(0, 6, dev6, csum, 1, std::nanf("")).end()), Code::kParamInvalid,
            "address: a bandwidth that is not a number");
  checkCode(verdict(AddressBuilder().device(0, 6, dev6, csum, 1, 0.0f).end()), Code::kParamInvalid,
            "address: a zero bandwidth");
  std::string ep_addr = AddressBuilder().device(0, 6, dev6, csum, 1).end();
  ep_addr[9 + 2 + 6 + 2 + 16] |= 0x40;
  checkCode(verdict(ep_addr), Code::kParamInvalid, "address: endpoint addresses");
  AddressBuilder many;
  for (int d = 0; d < 3; ++d) many.device(0, 6, dev6, 0x1234, 43);
  checkCode(verdict(many.end()), Code::kParamInvalid, "address: 129 transports");
  checkCode(verdict(std::string("\x20", 1) + std::string(8, 'u') + "\xff"), Code::kParamInvalid, "address: no devices");
  std::string v2 = std::string("\x61\x02", 2) + std::string(8, 'u') + std::string("\x00\x86", 2) + dev6 +
                   std::string("\xcf\x19\x0c\x01\x5a\x00\x01\x00\x02\x00\x82\x07\x07", 13);
  checkCode(verdict(v2), Code::kParamInvalid, "address: a v2 active-message transport of a 64-byte segment");
  v2[2 + 8 + 2 + 6 + 2 + 4] = '\x80';  // 8 KiB
  checkCode(verdict(v2), Code::kSuccess, "address: the same of an 8 KiB segment");
  checkCode(parseWorkerAddress(reinterpret_cast<const uint8_t*>(v2.data()), v2.size(), kAddressMinorLast + 1).status(),
            Code::kFeatureNotEnabled, "address: a UCX release whose layout is not known");
}

}  // namespace

int main() {
  testTransportsFor();
  testAutoChoice();
  Result<const UcpApi*> api = load();
  if (!api.ok()) {
    const char* require = std::getenv("PDLINK_REQUIRE_UCX");
    if (require != nullptr && std::string(require) == "1") {
      check(false, "PDLINK_REQUIRE_UCX=1 and " + api.status().message());
    } else {
      std::printf("ucx_test: UCX checks not run: %s\n", api.status().message().c_str());
    }
  } else {
    std::printf("ucx_test: %s (UCX %s)\n", api.value()->library.c_str(), api.value()->version.c_str());
    testMoves(api.value(), WorkerScope::kNetwork);
    testMoves(api.value(), WorkerScope::kAny);
    // The checks that hand UCX addresses of any IP run in children with a private network; without
    // one (not root) they are not run, and PDLINK_REQUIRE_NETNS=1 (.ci/ucx.sh) makes that a failure.
    std::string why;
    if (privateNetworkWorks(&why)) {
      check(garbageAddressKillsTheProcess(api.value()),
            "UCX survived worker addresses of random bytes: docs/ucx.md's trust section can be revisited");
      testAddressCheck(api.value());
    } else {
      const char* require = std::getenv("PDLINK_REQUIRE_NETNS");
      if (require != nullptr && std::string(require) == "1") {
        check(false, "PDLINK_REQUIRE_NETNS=1 and no private network namespace: " + why);
      } else {
        std::printf("ucx_test: the worker-address checks not run: no private network namespace (%s)\n", why.c_str());
      }
    }
  }
  if (testing::failures) {
    std::printf("ucx_test: %d checks failed\n", testing::failures);
    return 1;
  }
  std::printf("ucx_test: all checks passed\n");
  return 0;
}
