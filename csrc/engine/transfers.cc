// Transfers (engine/transfers.h): this side's requests, planned, split within the per-request
// bounds and posted on the link's path; the paths themselves move the bytes (transport/path.h,
// transport/*/).
#include "engine/transfers.h"

#include <algorithm>
#include <cstring>

#include "core/limits.h"
#include "core/log.h"
#include "core/seeded_bug.h"
#include "engine/engine_internal.h"
#include "transport/path.h"
#include "transport/frames.h"
#include "transport/tcp/stream_path.h"

namespace pdlink {

using namespace detail;  // NOLINT: this file is part of the engine

Transfers::Transfers(EngineState& state, LinkManager& links)
    : s_(state), links_(links), staged_path_(std::make_unique<StreamPath>(false, s_.backend.get())) {}

// ---------------------------------------------------------------- transfers

namespace {

// Adds the range pair (local offset, remote offset, length) to a plan, merged into the last pair
// when it continues it on both sides (consecutive blocks move as one range).
void appendRun(TransferPlan& p, uint64_t local_offset, uint64_t remote_offset, uint64_t length) {
  if (!p.local_runs.empty() && p.local_runs.back().offset + p.local_runs.back().length == local_offset &&
      p.remote.runs.back().offset + p.remote.runs.back().length == remote_offset) {
    p.local_runs.back().length += length;
    p.remote.runs.back().length += length;
  } else {
    p.local_runs.push_back({local_offset, length});
    p.remote.runs.push_back({remote_offset, length});
  }
}

// plan's steps. The tensor mapping: every local tensor i <-> i, or the spec's pairs (local
// indices checked here, remote ones by the peer).
Status mapTensors(const TransferSpec& spec, const CacheLayout& L, TransferPlan* out) {
  TransferPlan& p = *out;
  if (spec.local_tensors.empty()) {
    for (uint32_t t = 0; t < L.num_tensors; ++t) p.local_tensors.push_back(t);
    p.remote.tensors = p.local_tensors;
    return Status::OK();
  }
  if (spec.local_tensors.size() != spec.remote_tensors.size()) {
    return Status(Code::kParamInvalid, "source and destination layer ranges cover different tensor counts");
  }
  for (uint32_t t : spec.local_tensors) {
    if (t >= L.num_tensors) {
      return Status(Code::kParamInvalid, "tensor index " + std::to_string(t) + " out of range: local cache has " +
                                             std::to_string(L.num_tensors) + " tensors");
    }
  }
  p.local_tensors = spec.local_tensors;
  p.remote.tensors = spec.remote_tensors;
  return Status::OK();
}

// kExplicit: the spec's runs, each local one inside the local tensors and as long as its remote one.
Status explicitRuns(const TransferSpec& spec, const CacheLayout& L, TransferPlan* out) {
  if (spec.local_runs.size() != spec.remote_runs.size() || spec.local_runs.empty()) {
    return Status(Code::kParamInvalid, "local and remote run lists must be non-empty and of equal length");
  }
  for (size_t i = 0; i < spec.local_runs.size(); ++i) {
    const wire::Run& l = spec.local_runs[i];
    uint64_t end = 0;
    if (l.length == 0 || l.length != spec.remote_runs[i].length || __builtin_add_overflow(l.offset, l.length, &end) ||
        end > L.tensor_size) {
      return Status(Code::kParamInvalid, "local range [" + std::to_string(l.offset) + ", +" + std::to_string(l.length) +
                                             ") is outside the local tensors (" + std::to_string(L.tensor_size) +
                                             " bytes) or mismatches the remote one");
    }
  }
  out->local_runs = spec.local_runs;
  out->remote.runs = spec.remote_runs;
  return Status::OK();
}

// kSlotToSlot: one batch slot of a non-blocks cache, `size` bytes of it (the whole slot by default).
Status slotRuns(const TransferSpec& spec, const CacheLayout& L, TransferPlan* out) {
  const uint64_t stride = L.stride();
  if (L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a non-blocks local cache");
  if (spec.local_slot >= L.num_slots) {
    return Status(Code::kParamInvalid, "batch_index " + std::to_string(spec.local_slot) +
                                           " out of range: local batch size is " + std::to_string(L.num_slots));
  }
  uint64_t len = spec.size > 0 ? static_cast<uint64_t>(spec.size) : stride;
  if (len > stride) {
    return Status(Code::kParamInvalid,
                  "size " + std::to_string(len) + " exceeds the local slot size " + std::to_string(stride));
  }
  out->local_runs.push_back({spec.local_slot * stride, len});
  out->remote.runs.push_back({0, len});
  return Status::OK();
}

// kBlocksToBlocks, kSlotToBlocks: one run per block pair, consecutive blocks merged (appendRun).
Status blockRuns(const TransferSpec& spec, const CacheLayout& L, bool is_push, TransferPlan* out) {
  using Mode = TransferSpec::Mode;
  TransferPlan& p = *out;
  const uint64_t stride = L.stride();
  if (!L.is_blocks) return Status(Code::kParamInvalid, "this transfer needs a blocks cache on the local side");
  const bool pairs = spec.mode == Mode::kBlocksToBlocks;
  if (spec.local_blocks.empty()) return Status(Code::kParamInvalid, "the block list is empty");
  if (pairs && spec.local_blocks.size() != spec.remote_blocks.size()) {
    return Status(Code::kParamInvalid, "src_blocks and dst_blocks differ in length (" +
                                           std::to_string(spec.remote_blocks.size()) + " vs " +
                                           std::to_string(spec.local_blocks.size()) + ")");
  }
  if (is_push && !pairs) return Status(Code::kParamInvalid, "pushing a blocks cache into a slot is not supported");
  p.remote.block_size = pairs ? stride : 0;
  const uint64_t max_remote = UINT64_MAX / stride;
  for (size_t i = 0; i < spec.local_blocks.size(); ++i) {
    int64_t lb = spec.local_blocks[i];
    int64_t rb = pairs ? spec.remote_blocks[i] : static_cast<int64_t>(i);
    if (lb < 0 || static_cast<uint64_t>(lb) >= L.num_slots) {
      return Status(Code::kParamInvalid, "block index " + std::to_string(lb) + " out of range: local cache has " +
                                             std::to_string(L.num_slots) + " blocks");
    }
    if (rb < 0 || static_cast<uint64_t>(rb) >= max_remote) {
      return Status(Code::kParamInvalid, "remote block index " + std::to_string(rb) + " out of range");
    }
    appendRun(p, static_cast<uint64_t>(lb) * stride, static_cast<uint64_t>(rb) * stride, stride);
  }
  return Status::OK();
}

}  // namespace

Status Transfers::planAbsolute(const TransferSpec& spec, Resolved* scratch, TransferPlan* out) {
  if (spec.mode != TransferSpec::Mode::kExplicit) {
    return Status(Code::kParamInvalid, "absolute local addresses need an explicit (descriptor list) transfer");
  }
  if (spec.local_runs.size() != spec.remote_runs.size() || spec.local_runs.empty()) {
    return Status(Code::kParamInvalid, "local and remote run lists must be non-empty and of equal length");
  }
  for (size_t i = 0; i < spec.local_runs.size(); ++i) {
    if (spec.local_runs[i].length != spec.remote_runs[i].length) {
      return Status(Code::kParamInvalid, "descriptor " + std::to_string(i) + ": local and remote lengths differ");
    }
  }
  // The same resolution a peer's raw request gets, against this engine's own registry (every cache,
  // remote accessible or not): each range inside registered memory, or nothing moves. The whole
  // list at once, which may be several requests' worth (execute splits it): no bound on its steps
  // but the list's own (the caller's), each range at most limits::kMaxRawSpan.
  Status resolved = s_.registry.resolveRaw(spec.local_runs, false, scratch, UINT64_MAX);
  if (!resolved.ok()) return Status(Code::kParamInvalid, "local " + resolved.message());
  TransferPlan& p = *out;
  // Runs in a device backend's DEVICE memory: all of them go over the device paths; some of them,
  // over the stream path, staged (transferPart).
  size_t on_device = 0;
  p.local_device_runs.clear();
  for (Placement placement : scratch->run_placements) {
    const bool device = s_.device_transport && placement == Placement::kDevice;
    p.local_device_runs.push_back(device);
    on_device += device;
  }
  if (on_device == 0) p.local_device_runs.clear();
  // The caches stay registered through scratch->keep (the caller's), which p.local points at
  // without owning it.
  p.local = std::shared_ptr<const void>(std::shared_ptr<const void>(), &scratch->keep);
  p.local_absolute = true;
  p.local_addrs.assign(1, 0);  // runs are absolute: tensor 0 at address 0
  p.local_placement = on_device == spec.local_runs.size() ? Placement::kDevice : Placement::kHost;
  p.local_tensors.assign(1, 0);
  p.local_runs.assign(spec.local_runs.begin(), spec.local_runs.end());
  p.remote.target = spec.target;
  p.remote.block_size = 0;
  p.remote.tensors.assign(1, 0);
  p.remote.runs.assign(spec.remote_runs.begin(), spec.remote_runs.end());
  p.commit = true;
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return Status::OK();
}

Result<TransferPlan> Transfers::plan(const TransferSpec& spec, bool is_push) {
  auto local = s_.registry.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  TransferPlan p;
  p.local = local.value();
  p.local_addrs = local.value()->addrs;
  p.local_placement = local.value()->layout.placement;
  const CacheLayout& L = local.value()->layout;
  const uint64_t stride = L.stride();
  if (stride == 0) return Status(Code::kParamInvalid, "local cache has zero-sized slots");
  PDLINK_RETURN_IF_ERROR(mapTensors(spec, L, &p));
  p.remote.target = spec.target;
  using Mode = TransferSpec::Mode;
  if (spec.mode == Mode::kExplicit) {
    PDLINK_RETURN_IF_ERROR(explicitRuns(spec, L, &p));
  } else if (spec.mode == Mode::kSlotToSlot) {
    PDLINK_RETURN_IF_ERROR(slotRuns(spec, L, &p));
  } else {
    PDLINK_RETURN_IF_ERROR(blockRuns(spec, L, is_push, &p));
  }
  if (p.remote.tensors.size() > limits::kMaxRequestTensors) {
    return Status(Code::kParamInvalid, "a transfer moves at most " + std::to_string(limits::kMaxRequestTensors) +
                                           " tensors, got " + std::to_string(p.remote.tensors.size()));
  }
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  return p;
}

std::vector<TransferPlan> Transfers::split(const TransferPlan& p, uint64_t max_bytes) {
  // Each request names at most limits::kMaxRequestPieces (tensor, run) pieces, the bound every
  // server applies, and moves at most max_bytes (a run is cut at whole blocks where the target has
  // blocks, one block at least); a larger transfer becomes several requests of consecutive runs.
  // Only the last one commits a pulled request key.
  const uint64_t tensors = std::max<uint64_t>(1, p.remote.tensors.size());
  const uint64_t runs_per_request = std::max<uint64_t>(1, limits::kMaxRequestPieces / tensors);
  const uint64_t unit = p.block_unit > 0 ? p.block_unit : std::max<uint64_t>(1, p.remote.block_size);
  const uint64_t limit = std::max<uint64_t>(unit, max_bytes / tensors / unit * unit);  // bytes per tensor
  std::vector<TransferPlan> out;
  TransferPlan* cur = nullptr;
  uint64_t cur_len = 0;
  for (size_t i = 0; i < p.remote.runs.size(); ++i) {
    const wire::Run& l = p.local_runs[i];
    const wire::Run& r = p.remote.runs[i];
    for (uint64_t off = 0; off < r.length;) {
      if (cur == nullptr || cur->remote.runs.size() >= runs_per_request || cur_len >= limit) {
        TransferPlan c;
        c.local = p.local;
        c.local_absolute = p.local_absolute;
        c.local_addrs = p.local_addrs;
        c.local_placement = p.local_placement;
        c.local_tensors = p.local_tensors;
        c.remote.target = p.remote.target;
        c.remote.block_size = p.remote.block_size;
        c.remote.tensors = p.remote.tensors;
        c.cancel = p.cancel;
        c.abort = p.abort;
        c.abort_admitted = p.abort_admitted;
        out.push_back(std::move(c));
        cur = &out.back();
        cur_len = 0;
      }
      const uint64_t take = std::min(r.length - off, limit - cur_len);
      cur->local_runs.push_back({l.offset + off, take});
      cur->remote.runs.push_back({r.offset + off, take});
      if (!p.local_device_runs.empty()) cur->local_device_runs.push_back(p.local_device_runs[i]);
      cur_len += take;
      off += take;
    }
  }
  for (TransferPlan& c : out) {
    c.payload = c.remote.payloadBytes().value();  // a part of a sum that did not overflow
    c.commit = false;
  }
  if (!out.empty()) out.back().commit = p.commit;
  return out;
}

Result<wire::RawTable> Transfers::describeMemory(uint64_t cluster_id, int64_t timeout_ms) {
  if (timeout_ms <= 0) return Status(Code::kParamInvalid, "the timeout must be positive");
  EngineState::Admission admission(s_, s_.transfers_in_flight);
  if (!admission.admitted()) return admission.status();
  auto link_r = links_.usableLink(cluster_id);
  if (!link_r.ok()) return link_r.status();
  Link& link = *link_r.value();
  wire::TransferBody tb;
  tb.target.kind = wire::TargetKind::kRaw;
  const std::string body = wire::encode(tb);
  const char* what = "describing the memory of";
  const Deadline deadline = Deadline::afterMs(timeout_ms);
  std::lock_guard<std::mutex> out(link.outMutex());
  if (link.broken()) return linkDown(link);
  wire::ResponseHeader rh;
  PDLINK_RETURN_IF_ERROR(request(link, wire::RequestHeader{wire::Op::kDescribe, static_cast<uint32_t>(body.size()), 0},
                                 body, deadline, what, &rh));
  std::string payload;
  Status st = readAnswer(link.out(), rh.payload_len, wire::kMaxRawTableBytes, deadline, &payload, "memory table");
  wire::RawTable table;
  if (st.ok()) st = wire::decode(reinterpret_cast<const uint8_t*>(payload.data()), payload.size(), &table);
  if (!st.ok()) return failTransfer(link, st, what);
  return table;
}

template <class Move>
Status Transfers::counted(uint64_t peer, bool is_push, Move move) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  Outcome o;
  Status st = move(&o);
  Telemetry* t = s_.telemetry.get();
  if (t == nullptr) return st;  // not initialised (the call failed)
  Telemetry::Peer& counters = t->peer(peer);
  if (!st.ok()) {
    t->transferFailed(counters, o.path, is_push, st.code(), o.stage);
    return st;
  }
  const Clock::time_point end = Clock::now();
  const Clock::time_point wire = o.wire_start == Clock::time_point{} ? start : o.wire_start;
  auto ns = [](Clock::duration d) {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count());
  };
  t->transferDone(counters, o.path, is_push, o.bytes, o.descriptors, ns(wire - start), ns(end - wire), ns(end - start));
  return st;
}

Status Transfers::pull(const TransferSpec& spec) {
  return counted(spec.peer_cluster_id, false, [&](Outcome* o) { return transfer(spec, false, o); });
}
Status Transfers::push(const TransferSpec& spec) {
  return counted(spec.peer_cluster_id, true, [&](Outcome* o) { return transfer(spec, true, o); });
}

Status Transfers::transfer(const TransferSpec& spec, bool is_push, Outcome* outcome) {
  EngineState::Admission admission(s_, s_.transfers_in_flight);
  if (!admission.admitted()) return admission.status();
  auto link_r = links_.usableLink(spec.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  outcome->path = link_r.value()->transport();
  const int64_t timeout_ms = spec.timeout_ms > 0 ? spec.timeout_ms : s_.config.sync_timeout_ms;
  if (spec.local_absolute) {
    // Descriptor lists are the small, frequent transfers of transfer-engine callers: as post() does,
    // each thread reuses one plan and one resolution, whose vectors keep their capacity (no path
    // keeps a reference to either), and lets go of the local caches when the transfer is over.
    thread_local TransferPlan p;
    thread_local Resolved scratch;
    struct Release {
      TransferPlan& plan;
      Resolved& resolved;
      ~Release() {
        plan.local.reset();
        plan.cancel = nullptr;
        resolved.keep.clear();
      }
    } release{p, scratch};
    PDLINK_RETURN_IF_ERROR(planAbsolute(spec, &scratch, &p));
    p.cancel = spec.cancel;
    admission.arm(&p);
    outcome->bytes = p.payload;
    outcome->descriptors = spec.local_runs.size();
    return execute(link_r.value(), p, is_push, timeout_ms, outcome);
  }
  auto p_r = plan(spec, is_push);
  if (!p_r.ok()) return p_r.status();
  p_r.value().cancel = spec.cancel;
  admission.arm(&p_r.value());
  outcome->bytes = p_r.value().payload;
  // What the caller named, per tensor: its ranges, its blocks, or one slot.
  using Mode = TransferSpec::Mode;
  const uint64_t named = spec.mode == Mode::kExplicit     ? spec.local_runs.size()
                         : spec.mode == Mode::kSlotToSlot ? 1
                                                          : spec.local_blocks.size();
  outcome->descriptors = named * p_r.value().remote.tensors.size();
  return execute(link_r.value(), p_r.value(), is_push, timeout_ms, outcome);
}

namespace {

// `m` with every size set, or why it cannot map blocks of `local_bs` bytes (see BlockMapping).
Result<BlockMapping> resolveMapping(BlockMapping m, uint64_t local_bs) {
  if (m.remote_block_size == 0) m.remote_block_size = local_bs;
  if (m.block_ratio == 0) return Status(Code::kParamInvalid, "block_ratio must be at least 1");
  if (m.local_view_length == 0) {
    if (m.local_view_offset >= local_bs) return Status(Code::kParamInvalid, "the local view starts past the block");
    m.local_view_length = local_bs - m.local_view_offset;
  }
  uint64_t end = 0;
  if (__builtin_add_overflow(m.local_view_offset, m.local_view_length, &end) || end > local_bs) {
    return Status(Code::kParamInvalid, "the local view [" + std::to_string(m.local_view_offset) + ", +" +
                                           std::to_string(m.local_view_length) + ") is not inside a local block of " +
                                           std::to_string(local_bs) + " bytes");
  }
  if (m.local_view_length % m.block_ratio != 0) {
    return Status(Code::kParamInvalid, "the local view (" + std::to_string(m.local_view_length) +
                                           " bytes) does not divide into block_ratio " + std::to_string(m.block_ratio) +
                                           " equal pieces");
  }
  const uint64_t piece = m.local_view_length / m.block_ratio;
  if (m.remote_view_length == 0) m.remote_view_length = piece;
  if (m.remote_view_length != piece) {
    return Status(Code::kParamInvalid, "the remote view (" + std::to_string(m.remote_view_length) +
                                           " bytes) is not the local view's share per remote block (" +
                                           std::to_string(piece) + " bytes)");
  }
  if (__builtin_add_overflow(m.remote_view_offset, m.remote_view_length, &end) || end > m.remote_block_size) {
    return Status(Code::kParamInvalid, "the remote view [" + std::to_string(m.remote_view_offset) + ", +" +
                                           std::to_string(m.remote_view_length) + ") is not inside a remote block of " +
                                           std::to_string(m.remote_block_size) + " bytes");
  }
  return m;
}

}  // namespace

Result<std::shared_ptr<PreparedTransfer>> Transfers::prepare(const TransferSpec& spec, uint64_t block_size,
                                                             uint64_t remote_base, uint64_t remote_bytes,
                                                             const BlockMapping& mapping) {
  const bool raw = spec.target.kind == wire::TargetKind::kRaw;
  if (!raw && spec.target.kind != wire::TargetKind::kBlocks) {
    return Status(Code::kParamInvalid, "a prepared transfer addresses a blocks cache by key, or registered memory");
  }
  // The generation is read before the cache is looked up: a change in between makes the first
  // post check again.
  const uint64_t generation = s_.registry.published()->generation.load(std::memory_order_acquire);
  auto local = s_.registry.get(spec.local_cache_id);
  if (!local.ok()) return local.status();
  const CacheLayout& L = local.value()->layout;
  if (block_size == 0) block_size = L.stride();
  if (block_size == 0 || L.tensor_size % block_size != 0) {
    return Status(Code::kParamInvalid, "block size " + std::to_string(block_size) +
                                           " does not divide the local tensors (" + std::to_string(L.tensor_size) +
                                           " bytes)");
  }
  auto resolved = resolveMapping(mapping, block_size);
  if (!resolved.ok()) return resolved.status();
  auto p = std::make_shared<PreparedTransfer>();
  p->peer_cluster_id = spec.peer_cluster_id;
  p->target = spec.target;
  p->local_cache_id = spec.local_cache_id;
  p->block_size = block_size;
  p->mapping = resolved.value();
  p->local_blocks = L.tensor_size / block_size;
  if (spec.local_tensors.size() != spec.remote_tensors.size()) {
    return Status(Code::kParamInvalid, "local and remote tensor lists differ in length");
  }
  for (uint32_t t : spec.local_tensors) {
    if (t >= L.num_tensors)
      return Status(Code::kParamInvalid, "local tensor index " + std::to_string(t) + " out of range");
  }
  p->local_tensors = spec.local_tensors;
  p->remote_tensors = spec.remote_tensors;
  const size_t tensors = p->local_tensors.empty() ? L.num_tensors : p->local_tensors.size();
  if (tensors == 0 || tensors > limits::kMaxRequestTensors) {
    return Status(Code::kParamInvalid,
                  "a prepared transfer moves 1 to " + std::to_string(limits::kMaxRequestTensors) + " tensors");
  }
  if (raw) {
    uint64_t end = 0;
    if (tensors != 1) return Status(Code::kParamInvalid, "a transfer to registered memory moves one tensor");
    const uint64_t remote_bs = p->mapping.remote_block_size;
    if (remote_bytes < remote_bs || __builtin_add_overflow(remote_base, remote_bytes, &end)) {
      return Status(Code::kParamInvalid, "the remote memory is empty, smaller than a block, or wraps");
    }
    p->remote_base = remote_base;
    p->remote_blocks = remote_bytes / remote_bs;
  }
  p->local = local.value();
  p->generation.store(generation, std::memory_order_release);
  return p;
}

Status Transfers::post(PreparedTransfer& prep, const int64_t* local, const int64_t* remote, size_t n, bool is_push,
                       const CancelToken* cancel) {
  return counted(prep.peer_cluster_id, is_push,
                 [&](Outcome* o) { return postUncounted(prep, local, remote, n, is_push, cancel, o); });
}

Status Transfers::postUncounted(PreparedTransfer& prep, const int64_t* local, const int64_t* remote, size_t n,
                                bool is_push, const CancelToken* cancel, Outcome* outcome) {
  if (n == 0) return Status(Code::kParamInvalid, "the block list is empty");
  EngineState::Admission admission(s_, s_.transfers_in_flight);
  if (!admission.admitted()) return admission.status();
  auto link_r = links_.usableLink(prep.peer_cluster_id);
  if (!link_r.ok()) return link_r.status();
  outcome->path = link_r.value()->transport();
  // This side: the same cache, unless the registry changed since it was last checked.
  std::shared_ptr<CacheEntry> entry = prep.local.lock();
  const uint64_t now = s_.registry.published()->generation.load(std::memory_order_acquire);
  if (entry && now != prep.generation.load(std::memory_order_acquire)) {
    auto current = s_.registry.get(prep.local_cache_id);
    if (!current.ok() || current.value() != entry)
      entry.reset();
    else
      prep.generation.store(now, std::memory_order_release);  // re-prepared: still registered
  }
  if (!entry) {
    return Status(Code::kParamInvalid, "the prepared transfer's local cache " + std::to_string(prep.local_cache_id) +
                                           " is no longer registered; prepare it again");
  }
  // Posts are the small, frequent transfers: each thread reuses one plan, whose vectors keep their
  // capacity, so a post of a few blocks allocates nothing (no path keeps a reference to the plan).
  thread_local TransferPlan p;
  struct Release {  // the plan must not keep the local cache registered past this post
    TransferPlan& plan;
    ~Release() {
      plan.local.reset();
      plan.cancel = nullptr;
    }
  } release{p};
  p.cancel = cancel;
  admission.arm(&p);
  p.local_addrs.assign(entry->addrs.begin(), entry->addrs.end());
  p.local_placement = entry->layout.placement;
  p.local = std::move(entry);
  p.local_runs.clear();
  p.local_device_runs.clear();
  p.remote.runs.clear();
  p.commit = true;
  if (prep.local_tensors.empty()) {
    p.local_tensors.clear();
    for (uint32_t t = 0; t < p.local_addrs.size(); ++t) p.local_tensors.push_back(t);
    p.remote.tensors.assign(p.local_tensors.begin(), p.local_tensors.end());
  } else {
    p.local_tensors.assign(prep.local_tensors.begin(), prep.local_tensors.end());
    p.remote.tensors.assign(prep.remote_tensors.begin(), prep.remote_tensors.end());
  }
  p.remote.target = prep.target;
  const bool raw = prep.target.kind == wire::TargetKind::kRaw;
  const BlockMapping& m = prep.mapping;
  const uint64_t bs = prep.block_size, rbs = m.remote_block_size, piece = m.remote_view_length;
  p.remote.block_size = raw ? 0 : rbs;
  // a split by size cuts only between whole pieces: a block's piece is never half-written
  p.block_unit = piece;
  const uint64_t max_remote = raw ? prep.remote_blocks : UINT64_MAX / rbs;
  for (size_t i = 0; i < n; ++i) {
    const int64_t lb = local[i];
    if (lb < 0 || static_cast<uint64_t>(lb) >= prep.local_blocks) {
      return Status(Code::kParamInvalid, "block index " + std::to_string(lb) + " out of range: local cache has " +
                                             std::to_string(prep.local_blocks) + " blocks");
    }
    for (uint32_t j = 0; j < m.block_ratio; ++j) {
      const int64_t rb = remote[i * m.block_ratio + j];
      if (rb < 0 || static_cast<uint64_t>(rb) >= max_remote) {
        return Status(Code::kParamInvalid, "remote block index " + std::to_string(rb) + " out of range");
      }
      appendRun(p, static_cast<uint64_t>(lb) * bs + m.local_view_offset + j * piece,
                (raw ? prep.remote_base : 0) + static_cast<uint64_t>(rb) * rbs + m.remote_view_offset, piece);
    }
  }
  auto payload = p.remote.payloadBytes();
  if (!payload.ok()) return payload.status();
  p.payload = payload.value();
  outcome->bytes = p.payload;
  outcome->descriptors = n * m.block_ratio * p.remote.tensors.size();  // each block's pieces, per tensor
  // The epoch fence: the tag bound from the peer's first answer goes with every later post; the
  // first post binds it from the answer it gets (Link::epochTags).
  const uint32_t tag = prep.epoch_tag.load(std::memory_order_acquire);
  uint32_t seen = 0;
  Status st = execute(link_r.value(), p, is_push, s_.config.sync_timeout_ms, outcome, tag, &seen);
  if (tag == 0 && seen != 0 && st.ok()) {
    uint32_t expected = 0;
    prep.epoch_tag.compare_exchange_strong(expected, seen, std::memory_order_acq_rel);
  }
  return st;
}

Status Transfers::execute(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, int64_t timeout_ms,
                          Outcome* outcome, uint32_t epoch_tag, uint32_t* seen_tag) {
  const char* what = is_push ? "push to" : "pull from";

  std::lock_guard<std::mutex> out(link->outMutex());
  if (link->broken()) {  // broke while we waited for the channel
    return linkDown(*link);
  }
  // Under the out mutex: this transfer's requests carry `epoch_tag`, and the tag of the peer's
  // answers to them is read back (0: none answered).
  Link::EpochTags& tags = link->epochTags();
  tags.send = epoch_tag;
  tags.seen = 0;
  struct Reset {
    Link::EpochTags& tags;
    uint32_t* seen;
    ~Reset() {
      if (seen) *seen = tags.seen;
      tags.send = 0;
    }
  } reset{tags, seen_tag};
  Deadline deadline = Deadline::afterMs(timeout_ms);
  // Cancel points (docs/architecture.md): before the first request and between requests; a
  // cancellable transfer is cut into requests of at most limits::kCancelSliceBytes, so that a
  // cancel waits for at most the request in flight.
  // The engine's abort word (a drain timeout) is checked at the same points; a transfer without a
  // token is not sliced for it (its tcp chunks and its requests are its cancel points).
  const CancelPoint cancel = p.cancelPoint();
  if (cancel.requested()) return cancelledStatus(what);
  // Onto the wire: from here a failure is counted at the stage the link's helpers set (the out
  // mutex is held, so the link's stage is this transfer's).
  outcome->wire_start = std::chrono::steady_clock::now();
  link->setStage(TransferStage::kRequest);
  Status st;
  const bool slice = p.cancel != nullptr && p.payload > limits::kCancelSliceBytes;
  if (!slice && p.remote.pieces() <= limits::kMaxRequestPieces) {
    st = transferPart(link, p, is_push, deadline, what, outcome);
  } else {
    for (TransferPlan& part : split(p, slice ? limits::kCancelSliceBytes : UINT64_MAX)) {
      if (cancel.requested()) {
        st = cancelledStatus(what);
        break;
      }
      st = transferPart(link, part, is_push, deadline, what, outcome);
      if (!st.ok()) break;
    }
  }
  if (!st.ok()) outcome->stage = link->stage();
  return st;
}

Status Transfers::transferPart(const std::shared_ptr<Link>& link, TransferPlan& p, bool is_push, Deadline deadline,
                               const char* what, Outcome* outcome) {
  // A descriptor list (local_absolute) of a device backend whose ranges here, or at the peer, mix
  // HOST and DEVICE memory goes over the stream path, each side staging its DEVICE ranges: its
  // DEVICE ranges here are marked in the plan, the peer's show in its refusal of the other paths
  // (kFeatureNotEnabled, nothing moved).
  const bool staged = s_.device_transport && p.local_absolute && p.remote.target.kind == wire::TargetKind::kRaw;
  auto on = [&](DataPath& path) -> DataPath& {
    outcome->path = path.caps().name;
    return path;
  };
  auto fallBack = [&](const Status& st) {
    if (!staged || st.code() != Code::kFeatureNotEnabled || link->broken()) return st;
    return on(*staged_path_).transfer(*link, p, is_push, deadline, what);
  };
  if (!(s_.device_transport && p.local_placement == Placement::kDevice)) {
    if (!p.local_device_runs.empty()) return on(*staged_path_).transfer(*link, p, is_push, deadline, what);
    return fallBack(on(link->hostPath()).transfer(*link, p, is_push, deadline, what));
  }
  // DEVICE memory: the link's device paths in order; one that cannot take this transfer (and moved
  // nothing) leaves it to the next.
  Status last(Code::kFeatureNotEnabled, "no data path for device memory on this link");
  const std::vector<DataPath*> paths = link->devicePaths();  // a path may drop itself meanwhile
  for (DataPath* path : paths) {
    if (path->caps().device_channel) {
      // A peer without device channels (a CPU backend) turns the channel down and moves nothing: a
      // descriptor list then goes staged over the stream (fallBack), anything else fails with it.
      Status channel = path->connect(*link, s_.pathEnv(), deadline, what);
      if (channel.code() == Code::kFeatureNotEnabled && !link->broken()) {
        last = channel;
        continue;
      }
      PDLINK_RETURN_IF_ERROR(channel);
    }
    if (!path->usable(*link)) continue;
    last = on(*path).transfer(*link, p, is_push, deadline, what);
    if (last.code() != Code::kFeatureNotEnabled || link->broken()) return last;
  }
  return fallBack(last);
}

}  // namespace pdlink
