// Limits: the bounds on what one peer can make this process spend, in one table.
//
// Every count or size a peer sends is checked against these before anything is allocated for it
// (transport/wire.h decoders, RequestServer::admit). Both ends of a link apply the same table: a
// requester splits a transfer that would exceed a per-request bound into several requests
// (Transfers::plan), so honest callers never meet them; a server refuses a request that exceeds one.
// The binding exposes the table once (pdlink._core.LIMITS); Python never re-types a value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pdlink::limits {

// Tensors one request may name (a cache has at most this many; llm_datadist's largest models
// register a few hundred).
constexpr uint32_t kMaxRequestTensors = 1u << 16;
// Tensors x runs of one request: the byte ranges a server resolves, pins and, on the direct and
// one-sided paths, answers with addresses for (16 bytes each: at most 4 MiB per answer).
constexpr uint64_t kMaxRequestPieces = uint64_t{1} << 18;
// The most peers EngineLimits::max_metric_peers may give series of their own (engine/telemetry.h).
constexpr uint32_t kMaxMetricPeers = 4096;
// Raw-address ranges (a kRaw target: registered memory named by absolute address, as descriptor
// lists do). A server finds a range's memory through an index of every registered tensor by start
// address, one step per registration the range runs across (Registry::resolve); a requester that
// holds the server's memory table finds it the same way (transport/cma/cma_path.cc). Per step, of
// the registrations that start closest at or below the current address this many are considered:
constexpr size_t kRawCandidates = 16;
// and one range may run across at most this many registrations that follow each other exactly.
constexpr size_t kMaxRawSpan = 64;
// Steps of all the raw ranges of one request together (a range inside one registration is one
// step): the index look-ups, write and placement checks one request makes a server do, bounded
// by this rather than by kMaxRequestPieces x kMaxRawSpan (16.7 M). A request of the most ranges
// (kMaxRequestPieces) may average 4 registrations per range; one of up to 16,384 ranges may run
// every range across kMaxRawSpan registrations. A request past it is refused when its step count
// passes the bound, before anything more of it is resolved.
constexpr uint64_t kMaxRequestSpanSteps = uint64_t{1} << 20;
// A request body: the target (57 bytes), two counts, the tensor list and the runs.
constexpr uint32_t kMaxBodyBytes =
    static_cast<uint32_t>(64 + 4 * uint64_t{kMaxRequestTensors} + 16 * kMaxRequestPieces);
// Error text in responses, acks and auth results.
constexpr uint32_t kMaxMessageBytes = 64u << 10;
// Bodies and answers are read in chunks of this size as their bytes arrive, so a header that
// announces a large body costs memory only once the bytes are really there.
constexpr size_t kReadChunkBytes = 64u << 10;
// An IPC key on the wire (ACL's are 65-byte C strings: 64 characters and the NUL).
constexpr size_t kIpcKeyBytes = 64;
// With payload integrity, a payload travels in chunks of this size, each with its own tag: the
// receiver lands a chunk in its destination only once the tag checked out, staging at most one
// chunk per transfer (transport/auth_stream.h).
constexpr size_t kPayloadChunkBytes = 256u << 10;
// A tcp link's streams (EngineLimits::tcp_streams): at most this many per link (its out channel
// and kMaxTcpStreams - 1 lanes), whatever an engine is configured with.
constexpr uint32_t kMaxTcpStreams = 16;
// The chunk of a tcp transfer split over several streams (EngineLimits::tcp_chunk_bytes) lies in
// [kMinTcpChunkBytes, kMaxTcpChunkBytes]; each stream keeps at most kMaxTcpDepth chunks in flight.
constexpr uint64_t kMinTcpChunkBytes = 64u << 10;
constexpr uint64_t kMaxTcpChunkBytes = 64u << 20;
constexpr uint32_t kMaxTcpDepth = 8;
// A cancellable transfer (one with a cancel token: the async transfers) larger than this is posted
// as requests of at most this many payload bytes (whole blocks where the target has blocks; one
// block larger than this stays whole), so that a cancel stops it after at most the requests in
// flight (docs/architecture.md, "Cancel points").
constexpr uint64_t kCancelSliceBytes = uint64_t{8} << 20;
// The engine remembers this many of the latest link installations (Engine::linkedSince), so that
// a status poll learns of a link that came and went between two polls.
constexpr size_t kLinkLogEntries = 1024;
// A notification (Engine::notify, wire::NotifyBody): its name and its message. Both sides refuse
// longer ones; how many a receiver keeps unread is an engine limit (EngineLimits).
constexpr uint32_t kMaxNotifyNameBytes = 4u << 10;
constexpr uint32_t kMaxNotifyMessageBytes = 64u << 10;
// A KV handoff frame (wire::HandoffBody): an abort's request id and reason, and the offers one hold
// names (16 bytes each: 1 MiB at most). Both sides refuse more.
constexpr uint32_t kMaxHandoffRequestIdBytes = 256;
constexpr uint32_t kMaxHandoffReasonBytes = 256;
constexpr uint32_t kMaxHoldOffers = 1u << 16;
// An AF_UNIX abstract socket name offered for a same-host link (sun_path minus the leading NUL).
constexpr size_t kUnixNameBytes = 64;

}  // namespace pdlink::limits
