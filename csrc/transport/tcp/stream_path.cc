// The stream path (transport/tcp/stream_path.h).
#include "transport/tcp/stream_path.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "transport/frames.h"

namespace pdlink {

StreamPath::StreamPath(bool unix_socket, Backend* backend) : backend_(backend) {
  caps_.name = unix_socket ? "unix" : "tcp";
  caps_.request_flags = 0;
  caps_.cross_host = !unix_socket;
}

namespace {

// The payload of one side: its pieces straight from (or into) memory, or staged when some lie in
// DEVICE memory (`device`, per run: then tensors is {0} and the runs absolute).
Status move(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
            uint64_t base, const std::vector<wire::Run>& runs, const std::vector<uint8_t>& device, Backend* backend,
            Deadline deadline, std::vector<iovec> frame = {}) {
  if (device.empty()) return movePayload(s, sending, addrs, tensors, base, runs, deadline, std::move(frame));
  return moveStagedPayload(s, sending, pieces(addrs, tensors, base, runs), device, *backend, deadline,
                           std::move(frame));
}

// One chunk of a transfer split over the link's streams: its own request body (a TransferBody naming
// a part of the transfer's remote ranges) and the local ranges (absolute addresses) its payload
// lands in or comes from, in payload order.
struct Chunk {
  std::string body;
  uint64_t payload = 0;
  std::vector<wire::Run> local;
};

// Cuts `p` into chunks of at most `chunk` bytes, in payload order: a tensor whose ranges hold at least
// a chunk is cut along its runs (one tensor per chunk), smaller tensors are grouped whole. Each
// chunk's body names a subset of the plan's remote ranges (same target, block size and tensors), so
// the peer admits and resolves it exactly like the whole request.
std::vector<Chunk> cut(const TransferPlan& p, uint64_t chunk) {
  const wire::TransferBody& rb = p.remote;
  uint64_t per_tensor = 0;
  for (const wire::Run& r : rb.runs) per_tensor += r.length;
  std::vector<std::pair<wire::TransferBody, uint64_t>> bodies;
  auto fresh = [&rb] {
    wire::TransferBody b;
    b.target = rb.target;
    b.block_size = rb.block_size;
    return b;
  };
  if (per_tensor >= chunk) {
    for (uint32_t t : rb.tensors) {
      wire::TransferBody b = fresh();
      b.tensors = {t};
      uint64_t n = 0;
      for (const wire::Run& r : rb.runs) {
        uint64_t off = r.offset, len = r.length;
        while (len > 0) {
          const uint64_t take = std::min(len, chunk - n);
          b.runs.push_back({off, take});
          n += take, off += take, len -= take;
          if (n == chunk) {
            bodies.emplace_back(std::move(b), n);
            b = fresh();
            b.tensors = {t};
            n = 0;
          }
        }
      }
      if (n > 0) bodies.emplace_back(std::move(b), n);
    }
  } else if (per_tensor > 0) {
    const size_t k = std::max<uint64_t>(1, chunk / per_tensor);
    for (size_t i = 0; i < rb.tensors.size(); i += k) {
      wire::TransferBody b = fresh();
      b.tensors.assign(rb.tensors.begin() + i, rb.tensors.begin() + std::min(i + k, rb.tensors.size()));
      b.runs = rb.runs;
      const uint64_t n = per_tensor * b.tensors.size();
      bodies.emplace_back(std::move(b), n);
    }
  }
  // The local side's pieces, cut at the same payload offsets.
  const std::vector<Segment> local = pieces(p.local_addrs, p.local_tensors, 0, p.local_runs);
  std::vector<Chunk> out;
  out.reserve(bodies.size());
  size_t li = 0;
  uint64_t lo = 0;  // bytes of local[li] already taken
  for (auto& [body, n] : bodies) {
    Chunk c;
    c.body = wire::encode(body);
    c.payload = n;
    for (uint64_t need = n; need > 0;) {
      while (li < local.size() && lo == local[li].length) ++li, lo = 0;
      if (li == local.size()) return {};  // sizes disagree: not for cutting (the caller checked they agree)
      const uint64_t take = std::min(need, local[li].length - lo);
      c.local.push_back({local[li].addr + lo, take});
      lo += take, need -= take;
    }
    out.push_back(std::move(c));
  }
  return out;
}

// What the streams of one split transfer share: the next chunk to take (work sharing: a slow stream
// takes fewer), the first failure and whether it broke the streams.
struct Shared {
  std::vector<Chunk>& chunks;
  CancelPoint cancel;  // the transfer's (core/cancel.h): a cancel point before each chunk request
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex mu;
  Status failed;           // the first transport failure (the link is broken)
  Status refused;          // the first refusal by the peer (the link is fine)
  bool transport = false;  // failed is set
};

// One stream's share of a split transfer: keeps up to `depth` chunk requests in flight (the request
// of chunk k+1 goes out before the answer to chunk k is read), taking chunks until none is left, then
// reads every answer it is owed. A refusal stops the taking (the answers owed are still read, so the
// stream stays in step); a transport failure breaks the link at once, which wakes every other stream.
void runStream(Link& link, Stream& s, bool is_push, Shared& sh, uint32_t depth, Deadline deadline) {
  std::deque<size_t> owed;
  auto fail = [&](const Status& st) {
    {
      std::lock_guard<std::mutex> lock(sh.mu);
      if (!sh.transport) {
        sh.transport = true;
        sh.failed = st;
      }
    }
    sh.stop = true;
    link.breakLink(st.message());
  };
  for (;;) {
    while (!sh.stop.load() && owed.size() < depth) {
      if (sh.cancel.requested()) break;  // the answers owed are still read
      const size_t k = sh.next.fetch_add(1);
      if (k >= sh.chunks.size()) break;
      Chunk& c = sh.chunks[k];
      wire::RequestHeader h{is_push ? wire::Op::kWrite : wire::Op::kRead, static_cast<uint32_t>(c.body.size()),
                            is_push ? c.payload : 0, 0, fenceTag(link, wire::Op::kRead)};
      h.split = !is_push;  // a chunk of a split pull (wire::kMarkSplit)
      std::string head = wire::encode(h);
      std::vector<iovec> iov{{head.data(), head.size()}, {c.body.data(), c.body.size()}};
      Status st =
          is_push ? movePayload(s, true, {0}, {0}, 0, c.local, deadline, std::move(iov)) : s.sendFrame(iov, deadline);
      if (!st.ok()) return fail(st);
      owed.push_back(k);
    }
    if (owed.empty()) return;
    Chunk& c = sh.chunks[owed.front()];
    owed.pop_front();
    wire::ResponseHeader rh;
    Status remote;
    Status st = readResponse(s, deadline, &rh, &remote);
    if (!st.ok()) return fail(st);
    link.epochTags().seen.store(rh.epoch_tag, std::memory_order_relaxed);
    if (!remote.ok()) {
      std::lock_guard<std::mutex> lock(sh.mu);
      if (sh.refused.ok()) sh.refused = remote;
      sh.stop = true;
      continue;
    }
    if (is_push) continue;
    if (rh.payload_len != c.payload) {
      return fail(Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) +
                                                " bytes of a chunk, expected " + std::to_string(c.payload)));
    }
    st = movePayload(s, false, {0}, {0}, 0, c.local, deadline);
    if (!st.ok()) return fail(st);
  }
}

// Requests in flight per stream: enough that one stream's chunks cover the measured round trip at
// 10 Gb/s (rtt x 1.25 GB/s / chunk, plus the one being answered), at least 2, at most kMaxTcpDepth.
uint32_t depthFor(uint64_t rtt_us, uint64_t chunk) {
  const uint64_t bdp = rtt_us * 1250;  // bytes at 10 Gb/s
  const uint64_t d = 1 + (bdp + chunk - 1) / chunk;
  return static_cast<uint32_t>(std::clamp<uint64_t>(d, 2, limits::kMaxTcpDepth));
}

}  // namespace

Status StreamPath::transferSplit(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what,
                                 const std::vector<Stream*>& lanes, bool* split) {
  std::vector<Chunk> chunks = cut(p, link.chunkBytes());
  *split = !chunks.empty();
  if (!*split) return Status::OK();
  Shared sh{chunks, p.cancelPoint()};
  const uint32_t depth = depthFor(link.roundTripUs(), link.chunkBytes());
  std::vector<std::thread> threads;
  for (Stream* lane : lanes) {
    try {
      threads.emplace_back(
          [&link, lane, is_push, &sh, depth, deadline] { runStream(link, *lane, is_push, sh, depth, deadline); });
    } catch (const std::exception& e) {  // no thread to be had: the other streams take its chunks
      PDLINK_LOG(kInfo, "a lane of " << clusterName(link.peer()) << " sits this transfer out: " << e.what());
      break;
    }
  }
  link.setStage(TransferStage::kPayload);  // requests and payloads interleave on the streams
  runStream(link, link.out(), is_push, sh, depth, deadline);
  for (std::thread& t : threads) t.join();
  if (sh.transport) return failTransfer(link, sh.failed, what);
  // Every chunk was answered: the pull's end frame (wire::kMarkSplit), which closes it on the peer (a
  // role switch there waits for it; not answered).
  std::string end_body = wire::encode(p.remote);
  std::string end =
      wire::encode(wire::RequestHeader{wire::Op::kRelease, static_cast<uint32_t>(end_body.size()), 0, 0, 0, true});
  std::vector<iovec> end_iov{{end.data(), end.size()}, {end_body.data(), end_body.size()}};
  if (!link.out().sendFrame(end_iov, deadline).ok()) link.breakLink("could not end a split pull on the peer");
  if (!sh.refused.ok()) {  // the peer refused a chunk (as it would have refused the whole request); the link is fine
    link.setStage(TransferStage::kServed);
    Scope scope = sh.refused.scope() == Scope::kEngine ? Scope::kLink : sh.refused.scope();
    return Status(sh.refused.code(), scope,
                  std::string(what) + " " + clusterName(link.peer()) + ": " + sh.refused.message());
  }
  // Cancelled before every chunk was asked for: the chunks answered landed, no other byte did, and
  // nothing is committed.
  if (sh.next.load() < chunks.size()) return cancelledStatus(what);
  if (!is_push) commitPull(link, p, wire::encode(p.remote), deadline);
  return Status::OK();
}

Status StreamPath::transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) {
  if (!p.local_device_runs.empty() && backend_ == nullptr) {
    return Status(Code::kFeatureNotEnabled, "this stream path cannot stage DEVICE memory");
  }
  // A large transfer over several streams (a tcp link dialled by this side, EngineLimits::tcp_streams
  // > 1): its lanes open on the first such transfer, within half the time left. Only a pull is
  // split: a push stays one request, admitted whole by the peer before any byte lands, so a write
  // the peer refuses stores nothing (chunks admitted one by one would store those before the
  // refused one: the round-6 review's finding).
  if (link.streams() > 1 && p.local_device_runs.empty() && p.payload >= 2 * link.chunkBytes()) {
    link.openLanesOnce(Deadline::earliest(deadline, Deadline::afterMs(deadline.remainingMsForPoll() / 2)));
    std::vector<Stream*> lanes = link.outLanes();
    if (!is_push && !lanes.empty() && !link.broken()) {
      // Once split, the outcome is the transfer's: a chunk the peer refused (whatever its code, even
      // kFeatureNotEnabled) is not a reason to move the whole transfer again on the channel.
      bool split = false;
      Status st = transferSplit(link, p, is_push, deadline, what, lanes, &split);
      if (split || link.broken()) return st;
    }
  }
  Stream& s = link.out();
  std::string body = wire::encode(p.remote);
  wire::ResponseHeader rh;
  Status st;
  if (is_push) {  // the payload follows the request in the same stream
    wire::RequestHeader h{wire::Op::kWrite, static_cast<uint32_t>(body.size()), p.payload, 0,
                          fenceTag(link, wire::Op::kWrite)};
    std::string head = wire::encode(h);
    std::vector<iovec> iov{{head.data(), head.size()}, {body.data(), body.size()}};
    link.setStage(TransferStage::kPayload);  // the request and its payload go as one frame
    st = move(s, true, p.local_addrs, p.local_tensors, 0, p.local_runs, p.local_device_runs, backend_, deadline,
              std::move(iov));
    if (!st.ok()) return failTransfer(link, st, what);
    return awaitResponse(link, deadline, what, &rh);
  }
  st = request(link, wire::RequestHeader{wire::Op::kRead, static_cast<uint32_t>(body.size()), 0}, body, deadline, what,
               &rh);
  if (!st.ok()) return st;
  if (rh.payload_len != p.payload) {
    return failTransfer(link,
                        Status(Code::kLinkFailed, "peer sent " + std::to_string(rh.payload_len) + " bytes, expected " +
                                                      std::to_string(p.payload)),
                        what);
  }
  st = move(s, false, p.local_addrs, p.local_tensors, 0, p.local_runs, p.local_device_runs, backend_, deadline);
  if (!st.ok()) return failTransfer(link, st, what);
  commitPull(link, p, body, deadline);
  return Status::OK();
}

Status StreamServer::serve(ServeCall& call) {
  if (call.header.op == wire::Op::kWrite) {
    PDLINK_RETURN_IF_ERROR(move(call.stream, false, call.addrs, call.tensors, call.base, call.runs, call.device_runs,
                                &backend_, call.deadline));
    return sendResponse(call.stream, Status::OK(), call.deadline);
  }
  std::string head = wire::encode(wire::ResponseHeader{0, 0, call.payload, call.stream.epochTag()});
  return move(call.stream, true, call.addrs, call.tensors, call.base, call.runs, call.device_runs, &backend_,
              call.deadline, {{head.data(), head.size()}});
}

PathEntry streamEntry(Backend& backend) {
  PathEntry e;
  e.caps = StreamPath(false).caps();
  e.server = std::make_unique<StreamServer>(backend);
  e.applies = [](const LinkFacts&) { return true; };
  e.make = [](const LinkFacts& f) -> std::unique_ptr<DataPath> { return std::make_unique<StreamPath>(f.unix_socket); };
  return e;
}

}  // namespace pdlink
