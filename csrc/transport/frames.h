// Frames of one request/response exchange on a link's stream (transport/wire.h for the layouts):
// responses, answers and payloads, read and written within a deadline. Shared by the engine and
// every data path. Thread safety: as the Stream's (one thread per direction).
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "backends/backend.h"
#include "core/status.h"
#include "transport/stream.h"
#include "transport/wire.h"

namespace pdlink {

// A response header plus its message text, as one frame.
Status sendResponse(Stream& s, const Status& st, Deadline deadline);
// A successful response that carries an answer (a descriptor, addresses, IPC keys, options): the
// header, then the answer as a frame of its own.
Status sendAnswer(Stream& s, const std::string& answer, Deadline deadline);
// Reads a response header, and its message text (bounded) when the status is an error, and checks
// the frame. A malformed header (text on success, payload on an error) is kLinkFailed; `remote`
// receives the peer's status.
Status readResponse(Stream& s, Deadline deadline, wire::ResponseHeader* h, Status* remote);
// Reads the answer sendAnswer sent (`len` from its header, at most `max`) and checks its frame.
Status readAnswer(Stream& s, uint64_t len, uint64_t max, Deadline deadline, std::string* out, const char* what);
// Moves the payload of one transfer between a stream and memory, tensor-major (addrs[t] + base +
// run.offset), as a payload frame (Stream::payload: sealed or checked only with payload integrity).
// `frame` (sending only): the frame that precedes the payload (its header), sent in the same write
// when the stream has no tags. The caller guarantees every piece lies in memory it may touch.
Status movePayload(Stream& s, bool sending, const std::vector<uint64_t>& addrs, const std::vector<uint32_t>& tensors,
                   uint64_t base, const std::vector<wire::Run>& runs, Deadline deadline, std::vector<iovec> frame = {});
// movePayload of pieces some of which (`device[i]` non-zero) lie in a device backend's DEVICE memory,
// which the host cannot address: the payload moves chunk by chunk (limits::kPayloadChunkBytes)
// through one host buffer, `backend.copy` moving those pieces' bytes between it and DEVICE memory;
// the bytes on the wire are the same as movePayload's. At most one chunk of host memory is used
// whatever the payload's size. A failed device copy is returned as it is, the stream then out of
// step with the peer (the caller drops the link); a received chunk lands only after it checked out.
Status moveStagedPayload(Stream& s, bool sending, const std::vector<Segment>& pieces,
                         const std::vector<uint8_t>& device, Backend& backend, Deadline deadline,
                         std::vector<iovec> frame = {});
// Reads and drops the payload of a refused write (checked like any payload frame).
Status discardPayload(Stream& s, uint64_t len, Deadline deadline);

}  // namespace pdlink
