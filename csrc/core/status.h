// Status: the one error type of the pdlink core.
//
// Every fallible call in the core returns a Status (or a Result<T>). The numeric codes are the
// LLM-DataDist `LLMStatusCode` values, so a code crosses into Python (and onto the wire) unchanged
// and the binding converts it into an exception in exactly one place (bindings/status_bridge.h).
//
// Retry guidance, by code family (what the caller should do):
//   kParamInvalid, kFeatureNotEnabled      fix the call; retrying the same call will fail again.
//   kNotYetLink, kExistLink, kAlreadyLink   fix the link state first (link, unlink), then retry.
//   kKvCacheNotExist                        the remote key is absent; retry after checking it.
//   kTimeout, kLinkFailed                   the link is unusable: disconnect, then connect again.
//   kOutOfMemory                            free caches in the pool, then retry.
//   kStaleEpoch                             read the role state, prepare again, then retry.
//   kRoleSwitching                          wait until the switch is over (phase ready), then retry.
//   kOfferReleased                          the handoff is over (claimed, expired, aborted, link down):
//                                           ask the prefill side for the request again.
//
// Scope: what a failure concerns, so that a caller knows what else it affects without reading
// codes (a Status carries it; Python reads it as `_core.Scope`, pdlink.Scope):
//   kCall    the call itself: a bad argument, an absent key, a feature this engine lacks, a call
//            that the engine's state does not allow yet (switch_role while links exist). Other
//            calls, links and the engine are unaffected.
//   kLink    one peer's link: it failed, timed out, was refused, is busy, is not (or already)
//            linked, or the peer refused a request because of its own state. Other peers' links,
//            and calls in the same batch to other peers, are unaffected.
//   kEngine  this engine: not initialised (or finalised), out of memory or another resource (the
//            link cap, descriptors). Every call on it may fail the same way until that changes.
// The rule: a Status built from a code alone takes defaultScope(code) (the table in status.cc);
// a site whose failure concerns something else than its code's family passes the scope
// explicitly (the engine-not-initialised kFailed, the link cap's kLinkFailed, a peer's refusal
// that names the peer's own engine). Scope does not cross the wire: a peer's status read off the
// wire takes its code's default, and the code stays the only thing the wire and LLM-DataDist see.
// Threading: Status is a value type; copies are independent and safe to pass between threads.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <variant>

namespace pdlink {

// Numeric values are fixed by the LLM-DataDist API (0x5010B000 + n for the LLM codes).
enum class Code : uint32_t {
  kSuccess = 0x0,
  kFailed = 0xFFFFFFFFu,
  kWaitProcessTimeout = 0x5010B001,
  kKvCacheNotExist = 0x5010B002,
  kRepeatRequest = 0x5010B003,
  kRequestAlreadyCompleted = 0x5010B004,
  kParamInvalid = 0x5010B005,
  kEngineFinalized = 0x5010B006,
  kNotYetLink = 0x5010B007,
  kAlreadyLink = 0x5010B008,
  kLinkFailed = 0x5010B009,
  kUnlinkFailed = 0x5010B00A,
  kNotifyPromptUnlinkFailed = 0x5010B00B,
  kClusterNumExceedLimit = 0x5010B00C,
  kProcessingLink = 0x5010B00D,
  kDeviceOutOfMemory = 0x5010B00E,
  kPrefixAlreadyExist = 0x5010B00F,
  kPrefixNotExist = 0x5010B010,
  kSeqLenOverLimit = 0x5010B011,
  kNoFreeBlock = 0x5010B012,
  kBlocksOutOfMemory = 0x5010B013,
  kExistLink = 0x5010B018,
  kFeatureNotEnabled = 0x5010B019,
  kTimeout = 0x5010B01A,
  kLinkBusy = 0x5010B01B,
  kOutOfMemory = 0x5010B01C,
  // pdlink's own codes (0x5010B100 + n; no llm_datadist program's own calls ever see them:
  // docs/compatibility.md). kStaleEpoch: a role epoch the call (expected_epoch) or a prepared
  // transfer (its epoch tag, wire v7) was made against is no longer the engine's; nothing changed,
  // prepare again. kRoleSwitching: a role switch is pending on that engine (draining, switching or
  // rolling back); nothing changed, retry once it is ready. kOfferReleased: a KV handoff's offer
  // (engine/offers.h) was released (claimed, expired, aborted by either side, its link down) or
  // never existed; nothing more of it is served, and the message says why.
  kStaleEpoch = 0x5010B101,
  kRoleSwitching = 0x5010B102,
  kOfferReleased = 0x5010B103,
};

// What a failure concerns (above). Values are stable: Python and tests read them by name.
enum class Scope : uint8_t {
  kCall = 0,
  kLink = 1,
  kEngine = 2,
};

// The LLMStatusCode member name for a code ("LLM_TIMEOUT"); "LLM_FAILED" for unknown values.
const char* codeName(Code code);
// True when `value` is one of the codes above (used to validate codes read off the wire).
bool isKnownCode(uint32_t value);
// The scope a failure with `code` has unless its site says otherwise: kLink for the link codes
// (kNotYetLink, kAlreadyLink, kLinkFailed, kUnlinkFailed, kNotifyPromptUnlinkFailed,
// kProcessingLink, kLinkBusy, kTimeout, kWaitProcessTimeout), kEngine for kEngineFinalized and the
// out-of-memory codes (kOutOfMemory, kDeviceOutOfMemory, kBlocksOutOfMemory, kNoFreeBlock), kCall
// for every other code (kSuccess included).
Scope defaultScope(Code code);
// "CALL", "LINK", "ENGINE" (the names _core.Scope binds).
const char* scopeName(Scope scope);

class [[nodiscard]] Status {
 public:
  Status() = default;  // success
  // The scope is defaultScope(code).
  Status(Code code, std::string message) : code_(code), scope_(defaultScope(code)), message_(std::move(message)) {}
  // A failure whose scope is not its code's default (see "Scope" above).
  Status(Code code, Scope scope, std::string message) : code_(code), scope_(scope), message_(std::move(message)) {}

  static Status OK() { return Status(); }
  // A transfer stopped at a cancel point (core/cancel.h cancelledStatus): kFailed, scope kCall, and
  // marked, so the binding raises pdlink.TransferCancelled for it. Only this constructor marks a
  // Status: a status decoded off the wire never is, whatever its message says.
  static Status Cancelled(std::string message) {
    Status st(Code::kFailed, Scope::kCall, std::move(message));
    st.cancelled_ = true;
    return st;
  }

  bool ok() const { return code_ == Code::kSuccess; }
  Code code() const { return code_; }
  // kCall for OK.
  Scope scope() const { return scope_; }
  const std::string& message() const { return message_; }
  // Whether this is a Cancelled() status.
  bool cancelled() const { return cancelled_; }
  // "LLM_TIMEOUT: pull from cluster 2 timed out after 1000 ms"
  std::string toString() const;

 private:
  Code code_ = Code::kSuccess;
  Scope scope_ = Scope::kCall;
  bool cancelled_ = false;
  std::string message_;
};

// A value or the Status explaining why there is none (absl::StatusOr, arrow::Result).
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {}  // NOLINT: must not be OK
  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &std::get<T>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace pdlink

// Propagate a non-OK Status to the caller.
#define PDLINK_RETURN_IF_ERROR(expr) \
  do {                               \
    ::pdlink::Status _st = (expr);   \
    if (!_st.ok()) return _st;       \
  } while (0)
