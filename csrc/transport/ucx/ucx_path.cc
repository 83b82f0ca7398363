// The ucx data path (transport/ucx/ucx_path.h).
#include "transport/ucx/ucx_path.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "core/log.h"
#include "transport/frames.h"
#include "transport/tcp/stream_path.h"

namespace pdlink {
namespace ucx {
namespace {

constexpr unsigned kDataId = 0x7064;  // pdlink's Active Message id: one chunk of a transfer

// The header of every message.
struct ChunkHeader {
  uint64_t token;
  uint64_t chunk;
};

uint64_t randomToken() {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  uint64_t t = 0;
  while (t == 0) t = gen();
  return t;
}

}  // namespace

uint32_t chunkBytesFor(const std::vector<std::string>& lanes) {
  const bool tcp_only = !lanes.empty() && std::all_of(lanes.begin(), lanes.end(), [](const std::string& lane) {
    return transportFamily(lane) == "tcp";
  });
  return tcp_only ? kTcpChunkBytes : kChunkBytes;
}

void Chunks::cut(const std::vector<Segment>& ps, uint64_t bytes) {
  pieces = ps;
  chunk_bytes = bytes;
  first.clear();
  count = 0;
  for (const Segment& p : pieces) {
    first.push_back(count);
    count += (p.length + bytes - 1) / bytes;
  }
}

Segment Chunks::at(uint64_t i) const {
  const size_t p = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), i) - first.begin()) - 1;
  const uint64_t off = (i - first[p]) * chunk_bytes;
  return {pieces[p].addr + off, std::min(chunk_bytes, pieces[p].length - off)};
}

Result<std::shared_ptr<UcxHub>> UcxHub::open(bool decide_auto) {
  std::shared_ptr<UcxHub> hub(new UcxHub());
  Result<std::unique_ptr<UcxWorker>> network = UcxWorker::open(WorkerScope::kNetwork);
  if (!network.ok()) return network.status();
  Result<std::unique_ptr<UcxWorker>> local = UcxWorker::open(WorkerScope::kAny);
  if (!local.ok()) return local.status();
  hub->network_ = std::move(network.value());
  hub->local_ = std::move(local.value());
  if (decide_auto) {
    Result<std::vector<std::string>> lanes = hub->network_->lanesToSelf();
    if (lanes.ok()) {
      hub->auto_between_hosts_ = autoPicksUcx(lanes.value());
    } else {
      PDLINK_LOG(kInfo, "ucx: cannot tell the network worker's transports (" << lanes.status().message()
                                                                             << "); auto keeps tcp between hosts");
    }
  }
  UcxHub* raw = hub.get();
  for (UcxWorker* w : {hub->network_.get(), hub->local_.get()}) {
    PDLINK_RETURN_IF_ERROR(w->setHandler(kDataId, [raw](AmIncoming& in) { raw->onMessage(in); }));
  }
  hub->wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (hub->wake_fd_ < 0) return Status(Code::kFailed, "ucx: eventfd failed");
  hub->progress_ = std::thread([raw] { raw->progressLoop(); });
  return hub;
}

UcxHub::~UcxHub() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  if (wake_fd_ >= 0) {
    uint64_t one = 1;
    (void)::write(wake_fd_, &one, sizeof(one));
  }
  if (progress_.joinable()) progress_.join();
  if (wake_fd_ >= 0) ::close(wake_fd_);
  local_.reset();
  network_.reset();
}

void UcxHub::progressLoop() {
  // Each worker is progressed until it has nothing ready, then armed; the thread sleeps until one
  // of them (or the stop signal) has an event. Message handlers run here.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
    }
    network_->progress();
    local_->progress();
    if (!network_->arm() || !local_->arm()) continue;  // events arrived meanwhile
    pollfd fds[3] = {{network_->eventFd(), POLLIN, 0}, {local_->eventFd(), POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    (void)::poll(fds, 3, 100);
  }
}

std::shared_ptr<Expectation> UcxHub::expect(uint64_t* token) {
  auto e = std::make_shared<Expectation>();
  std::lock_guard<std::mutex> lock(mu_);
  do {
    *token = randomToken();
  } while (expectations_.count(*token));
  expectations_[*token] = e;
  return e;
}

void UcxHub::forget(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  expectations_.erase(token);
}

void UcxHub::open(Expectation& e, const std::vector<Segment>& pieces, uint64_t chunk_bytes) {
  std::lock_guard<std::mutex> lock(e.mu);
  e.chunks.cut(pieces, chunk_bytes);
  e.landed.assign(e.chunks.count, false);
  e.remaining = e.chunks.count;
  e.open = true;
}

void UcxHub::close(Expectation& e) {
  std::lock_guard<std::mutex> lock(e.mu);
  e.open = false;
}

Status UcxHub::await(Expectation& e, Deadline deadline, const char* what) {
  std::unique_lock<std::mutex> lock(e.mu);
  auto done = [&] { return e.remaining == 0; };
  if (deadline.isNever()) {
    e.cv.wait(lock, done);
  } else {
    while (!done() && !deadline.expired())
      e.cv.wait_for(lock, std::chrono::milliseconds(deadline.remainingMsForPoll()));
  }
  const uint64_t missing = e.remaining;
  e.open = false;  // under e.mu: no copy runs now, and none starts after this
  if (missing == 0) return Status::OK();
  return Status(Code::kTimeout, std::string(what) + ": " + std::to_string(missing) + " of " +
                                    std::to_string(e.chunks.count) + " ucx messages had not arrived by the deadline");
}

void UcxHub::onMessage(AmIncoming& in) {
  // Every check before the copy; a message that fails one is dropped and lands nowhere.
  ChunkHeader h{};
  if (in.header_length != sizeof(h) || in.rendezvous || in.bytes() == nullptr) return;
  std::memcpy(&h, in.header, sizeof(h));
  std::shared_ptr<Expectation> e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = expectations_.find(h.token);
    if (it == expectations_.end()) return;
    e = it->second.lock();
  }
  if (!e) return;
  std::lock_guard<std::mutex> lock(e->mu);  // held through the copy: close() waits for it
  if (!e->open || h.chunk >= e->chunks.count || e->landed[h.chunk]) return;
  const Segment where = e->chunks.at(h.chunk);
  if (in.length != where.length) return;
  std::memcpy(reinterpret_cast<void*>(where.addr), in.bytes(), in.length);
  e->landed[h.chunk] = true;
  if (--e->remaining == 0) e->cv.notify_all();
}

namespace {

// Sends `pieces` (local ranges) as chunks stamped with `token` over `ep`, kSendBatch messages at a
// time: what it holds is bounded by the batch, not by what a peer asked for.
Status sendChunks(UcxEndpoint& ep, uint64_t token, const std::vector<Segment>& pieces, uint32_t chunk_bytes,
                  Deadline deadline) {
  constexpr size_t kSendBatch = 4096;
  const size_t window = std::max(kMinSendWindow, kSendWindowBytes / chunk_bytes);
  std::vector<ChunkHeader> headers;
  std::vector<UcxEndpoint::Message> messages;
  headers.reserve(kSendBatch);
  messages.reserve(kSendBatch);
  uint64_t index = 0;
  auto flush = [&]() -> Status {
    Status st = messages.empty() ? Status::OK() : ep.sendAll(kDataId, messages, window, deadline);
    headers.clear();
    messages.clear();
    return st;
  };
  for (const Segment& p : pieces) {
    for (uint64_t at = 0; at < p.length; at += chunk_bytes) {
      headers.push_back({token, index++});
      const uint64_t n = std::min<uint64_t>(chunk_bytes, p.length - at);
      messages.push_back({&headers.back(), sizeof(ChunkHeader), reinterpret_cast<const void*>(p.addr + at), n});
      if (messages.size() == kSendBatch) PDLINK_RETURN_IF_ERROR(flush());
    }
  }
  return flush();
}

// What the serving side keeps per link (Link::inState under kServerSlot).
const PathSlot kServerSlot{"ucx server"};
struct ServerLink : PathLinkState {
  std::shared_ptr<UcxHub> hub;  // before ep: destroyed after it
  std::unique_ptr<UcxEndpoint> ep;
  uint64_t pull_token = 0;   // the requester's, for the bytes of its reads
  uint64_t push_token = 0;   // ours, for the bytes of its writes
  uint32_t chunk_bytes = 0;  // the link's message size (ours to choose, chunkBytesFor)
  std::shared_ptr<Expectation> pushes;
  ~ServerLink() override {
    if (hub && push_token) hub->forget(push_token);
  }
};

}  // namespace
}  // namespace ucx

// ------------------------------------------------------------------------------ UcxPath

const PathCaps UcxPath::kCaps{"ucx", wire::kFlagUcx, true, false, false, false};

UcxPath::UcxPath(std::shared_ptr<ucx::UcxHub> hub, bool same_host, std::unique_ptr<DataPath> fallback)
    : hub_(std::move(hub)), same_host_(same_host), fallback_(std::move(fallback)) {
  pulls_ = hub_->expect(&pull_token_);
}

UcxPath::~UcxPath() {
  ep_.reset();
  hub_->forget(pull_token_);
}

const PathCaps& UcxPath::caps() const { return declined_.load() ? fallback_->caps() : kCaps; }

std::vector<std::string> UcxPath::lanes() const {
  if (declined_.load()) return fallback_->lanes();
  std::lock_guard<std::mutex> lock(lanes_mu_);
  return lanes_;
}

Status UcxPath::connect(Link& link, Deadline deadline, const char* what) {
  ucx::UcxWorker& worker = hub_->worker(same_host_);
  // The path's kPathConnect: its header names the ucx entry (kCaps, whatever caps() says now).
  std::string body =
      wire::pathConnectBody(kCaps.request_flags, wire::encode(wire::UcxHello{pull_token_, 0, worker.address()}));
  wire::ResponseHeader rh;
  Status st = request(link, wire::RequestHeader{wire::Op::kPathConnect, static_cast<uint32_t>(body.size()), 0}, body,
                      deadline, what, &rh);
  if (!st.ok()) return st;  // a refusal (the peer has no ucx path) leaves the link as it was
  std::string payload;
  st = readAnswer(link.out(), rh.payload_len, wire::kMaxUcxHelloBytes, deadline, &payload, "ucx connect answer");
  wire::UcxHello theirs;
  if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &theirs);
  if (st.ok() && theirs.chunk_bytes == 0)
    st = Status(Code::kLinkFailed, "the peer's ucx connect answer has no message size");
  if (!st.ok()) return failTransfer(link, st, what);
  Result<std::unique_ptr<ucx::UcxEndpoint>> ep = worker.connect(theirs.address);
  if (!ep.ok()) return failTransfer(link, ep.status(), what);
  ep_ = std::move(ep.value());
  push_token_ = theirs.token;
  chunk_bytes_ = theirs.chunk_bytes;
  std::lock_guard<std::mutex> lock(lanes_mu_);
  lanes_ = ep_->lanes();
  return Status::OK();
}

Status UcxPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  // The engine sends DEVICE memory of a device backend down its device paths (or staged over the
  // stream); what reaches a host path is memory this process can address.
  if (!p.local_device_runs.empty()) return Status(Code::kFeatureNotEnabled, "the ucx path moves host memory only");
  if (declined_.load()) return fallback_->transfer(link, p, is_push, deadline, what);
  if (!ep_) {
    Status st = connect(link, deadline, what);
    if (st.code() == Code::kFeatureNotEnabled && fallback_ && !link.broken()) {
      PDLINK_LOG(kInfo, "ucx: the peer serves no ucx path (" << st.message() << "); this link keeps "
                                                             << fallback_->caps().name);
      declined_.store(true);
      return fallback_->transfer(link, p, is_push, deadline, what);
    }
    PDLINK_RETURN_IF_ERROR(st);
  }
  if (ep_->failed()) return failTransfer(link, Status(Code::kLinkFailed, "ucx: the peer's endpoint failed"), what);
  const std::vector<Segment> local = pieces(p.local_addrs, p.local_tensors, 0, p.local_runs);
  std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  if (!is_push) {
    ucx::UcxHub::open(*pulls_, local, chunk_bytes_);
    Status st = requestAccess(link, body, false, wire::kFlagUcx, deadline, what, &rh);
    if (st.ok() && rh.payload_len != 0) {
      st = failTransfer(link, Status(Code::kLinkFailed, "the peer answered a ucx read with a stream payload"), what);
    }
    if (!st.ok()) {  // refused (nothing was sent) or the link broke
      ucx::UcxHub::close(*pulls_);
      return st;
    }
    st = ucx::UcxHub::await(*pulls_, deadline, what);
    if (!st.ok()) return failTransfer(link, st, what);
    commitPull(link, p, body, deadline);
    return Status::OK();
  }
  Status st = requestAccess(link, body, true, wire::kFlagUcx, deadline, what, &rh);  // accepted?
  if (!st.ok()) return st;
  st = ucx::sendChunks(*ep_, push_token_, local, chunk_bytes_, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  return awaitResponse(link, deadline, what, &rh);  // stored
}

// ------------------------------------------------------------------------------ UcxServer

Status UcxServer::connect(Link& link, Stream& s, const std::string& body, Deadline deadline) {
  wire::UcxHello theirs;
  Status st = wire::decode(reinterpret_cast<const uint8_t*>(body.data()), body.size(), &theirs);
  if (!st.ok()) return st;  // a malformed frame: the link is dropped
  if (link.inState(ucx::kServerSlot))
    return sendResponse(s, Status(Code::kParamInvalid, "ucx is already connected"), deadline);
  ucx::UcxWorker& worker = hub_->worker(link.sameHost());
  Result<std::unique_ptr<ucx::UcxEndpoint>> ep = worker.connect(theirs.address);
  if (!ep.ok()) return sendResponse(s, ep.status(), deadline);
  auto owned = std::make_unique<ucx::ServerLink>();
  ucx::ServerLink* state = owned.get();
  state->hub = hub_;
  state->ep = std::move(ep.value());
  state->pull_token = theirs.token;
  state->chunk_bytes = ucx::chunkBytesFor(state->ep->lanes());
  state->pushes = hub_->expect(&state->push_token);
  link.setInState(ucx::kServerSlot, std::move(owned));
  return sendAnswer(s, wire::encode(wire::UcxHello{state->push_token, state->chunk_bytes, worker.address()}), deadline);
}

Status UcxServer::serve(ServeCall& call) {
  auto* state = static_cast<ucx::ServerLink*>(call.link.inState(ucx::kServerSlot));
  if (!state)
    return sendResponse(call.stream, Status(Code::kParamInvalid, "ucx is not connected on this link"), call.deadline);
  if (!call.device_runs.empty()) {
    return sendResponse(call.stream,
                        Status(Code::kFeatureNotEnabled,
                               "some of the addressed ranges are device "
                               "memory: the stream path moves them"),
                        call.deadline);
  }
  const std::vector<Segment> ranges = pieces(call.addrs, call.tensors, call.base, call.runs);
  if (call.header.op == wire::Op::kRead) {
    Status st = ucx::sendChunks(*state->ep, state->pull_token, ranges, state->chunk_bytes, call.deadline);
    if (!st.ok()) return st;  // the endpoint failed or timed out: drop the link
    return sendResponse(call.stream, Status::OK(), call.deadline);
  }
  uint64_t chunks = 0;
  for (const Segment& r : ranges) chunks += (r.length + state->chunk_bytes - 1) / state->chunk_bytes;
  if (chunks > ucx::kMaxChunksPerTransfer) {
    return sendResponse(call.stream,
                        Status(Code::kParamInvalid, "a ucx write of " + std::to_string(chunks) +
                                                        " messages is more than one transfer may be (" +
                                                        std::to_string(ucx::kMaxChunksPerTransfer) + "); split it"),
                        call.deadline);
  }
  ucx::UcxHub::open(*state->pushes, ranges, state->chunk_bytes);
  Status st = sendResponse(call.stream, Status::OK(), call.deadline);  // accepted: send the bytes
  if (!st.ok()) {
    ucx::UcxHub::close(*state->pushes);
    return st;
  }
  st = ucx::UcxHub::await(*state->pushes, call.deadline, "ucx write");
  if (!st.ok()) {
    (void)sendResponse(call.stream, st, call.deadline);
    return st;  // late bytes may still be on their way: drop the link
  }
  return sendResponse(call.stream, Status::OK(), call.deadline);
}

namespace ucx {

bool isPathOf(const UcxHub* hub, bool forced, const Link& link) {
  return hub && !link.payloadIntegrity() && (forced || (!link.sameHost() && hub->autoBetweenHosts()));
}

Status refused(const Link& link) {
  return Status(Code::kFeatureNotEnabled,
                link.payloadIntegrity()
                    ? "ucx is not used on a link with payload integrity (its bytes are sealed on the stream)"
                    : "this engine does not use ucx on this link (pdlink.Transport=ucx, or auto "
                      "between hosts with ucx_trusted_network)");
}

}  // namespace ucx

Status answerUcxConnect(UcxServer* server, bool forced, Link& link, Stream& s, const std::string& body,
                        Deadline deadline) {
  if (!server) {
    return sendResponse(s, Status(Code::kFeatureNotEnabled, "this engine has no ucx path (pdlink.Transport=ucx)"),
                        deadline);
  }
  if (!ucx::isPathOf(server->hub(), forced, link)) {
    PDLINK_LOG(kDebug,
               "refused a ucx connect from " << clusterName(link.peer()) << ": " << ucx::refused(link).message());
    return sendResponse(s, ucx::refused(link), deadline);
  }
  return server->connect(link, s, body, deadline);
}

PathEntry ucxEntry() {
  PathEntry e;
  e.caps = UcxPath::ucxCaps();
  e.applies = [](const LinkFacts& f) { return f.ucx != nullptr; };
  e.make = [](const LinkFacts& f) -> std::unique_ptr<DataPath> {
    // Picked by auto (between hosts, over an RDMA-capable UCX): the stream stays behind for a peer
    // without ucx. Forced: that peer's refusal is the transfer's result.
    std::unique_ptr<DataPath> fallback;
    if (f.auto_transport) fallback = std::make_unique<StreamPath>(f.unix_socket);
    return std::make_unique<UcxPath>(f.ucx, f.same_host, std::move(fallback));
  };
  // The ucx connect: a kPathConnect naming this entry, answered where this engine has no ucx path
  // too (the refusal).
  e.max_connect_body = wire::kMaxUcxHelloBytes;
  e.connect_what = "ucx connect";
  e.answer = [](const PathEntry& self, Link& link, Stream& s, const std::string& body, const PathEnv& env,
                Deadline deadline) {
    return answerUcxConnect(static_cast<UcxServer*>(self.server.get()), env.forced_ucx, link, s, body, deadline);
  };
  return e;
}

}  // namespace pdlink
