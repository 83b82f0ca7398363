#include "core/status.h"

namespace pdlink {

const char* codeName(Code code) {
  switch (code) {
    case Code::kSuccess:
      return "LLM_SUCCESS";
    case Code::kFailed:
      return "LLM_FAILED";
    case Code::kWaitProcessTimeout:
      return "LLM_WAIT_PROCESS_TIMEOUT";
    case Code::kKvCacheNotExist:
      return "LLM_KV_CACHE_NOT_EXIST";
    case Code::kRepeatRequest:
      return "LLM_REPEAT_REQUEST";
    case Code::kRequestAlreadyCompleted:
      return "LLM_REQUEST_ALREADY_COMPLETED";
    case Code::kParamInvalid:
      return "LLM_PARAM_INVALID";
    case Code::kEngineFinalized:
      return "LLM_ENGINE_FINALIZED";
    case Code::kNotYetLink:
      return "LLM_NOT_YET_LINK";
    case Code::kAlreadyLink:
      return "LLM_ALREADY_LINK";
    case Code::kLinkFailed:
      return "LLM_LINK_FAILED";
    case Code::kUnlinkFailed:
      return "LLM_UNLINK_FAILED";
    case Code::kNotifyPromptUnlinkFailed:
      return "LLM_NOTIFY_PROMPT_UNLINK_FAILED";
    case Code::kClusterNumExceedLimit:
      return "LLM_CLUSTER_NUM_EXCEED_LIMIT";
    case Code::kProcessingLink:
      return "LLM_PROCESSING_LINK";
    case Code::kDeviceOutOfMemory:
      return "LLM_DEVICE_OUT_OF_MEMORY";
    case Code::kPrefixAlreadyExist:
      return "LLM_PREFIX_ALREADY_EXIST";
    case Code::kPrefixNotExist:
      return "LLM_PREFIX_NOT_EXIST";
    case Code::kSeqLenOverLimit:
      return "LLM_SEQ_LENOVERLIMIT";
    case Code::kNoFreeBlock:
      return "LLM_NO_FREE_BLOCK";
    case Code::kBlocksOutOfMemory:
      return "LLM_BLOCKS_OUT_OF_MEMORY";
    case Code::kExistLink:
      return "LLM_EXIST_LINK";
    case Code::kFeatureNotEnabled:
      return "LLM_FEATURE_NOT_ENABLED";
    case Code::kTimeout:
      return "LLM_TIMEOUT";
    case Code::kLinkBusy:
      return "LLM_LINK_BUSY";
    case Code::kOutOfMemory:
      return "LLM_OUT_OF_MEMORY";
    case Code::kStaleEpoch:
      return "LLM_STALE_EPOCH";
    case Code::kRoleSwitching:
      return "LLM_ROLE_SWITCHING";
    case Code::kOfferReleased:
      return "LLM_OFFER_RELEASED";
  }
  return "LLM_FAILED";
}

bool isKnownCode(uint32_t value) {
  auto code = static_cast<Code>(value);
  return code == Code::kFailed || std::string(codeName(code)) != "LLM_FAILED";
}

Scope defaultScope(Code code) {
  switch (code) {
    case Code::kNotYetLink:
    case Code::kAlreadyLink:
    case Code::kLinkFailed:
    case Code::kUnlinkFailed:
    case Code::kNotifyPromptUnlinkFailed:
    case Code::kProcessingLink:
    case Code::kLinkBusy:
    case Code::kTimeout:
    case Code::kWaitProcessTimeout:
      return Scope::kLink;
    case Code::kEngineFinalized:
    case Code::kOutOfMemory:
    case Code::kDeviceOutOfMemory:
    case Code::kBlocksOutOfMemory:
    case Code::kNoFreeBlock:
    case Code::kRoleSwitching:  // every transfer of the engine is refused until the switch is over
      return Scope::kEngine;
    default:
      return Scope::kCall;
  }
}

const char* scopeName(Scope scope) {
  switch (scope) {
    case Scope::kCall:
      return "CALL";
    case Scope::kLink:
      return "LINK";
    case Scope::kEngine:
      return "ENGINE";
  }
  return "CALL";
}

std::string Status::toString() const {
  std::string s = codeName(code_);
  if (!message_.empty()) s += ": " + message_;
  return s;
}

}  // namespace pdlink
