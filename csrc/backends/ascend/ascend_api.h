// AscendApi: the one symbol table through which pdlink calls ACL and HCCL.
//
// The vendor libraries are loaded at run time with dlopen (RTLD_NOW | RTLD_LOCAL): pdlink builds
// and imports without any Ascend SDK. Search order for the directory holding libascendcl.so:
//   1. $PDLINK_ASCEND_LIB_DIR (when set, the libraries must be there: no fallback),
//   2. $ASCEND_HOME_PATH/lib64, 3. $ASCEND_TOOLKIT_HOME/lib64 (skipped when absent),
//   4. the dynamic loader's default path (plain sonames; LD_LIBRARY_PATH from set_env.sh).
// libhccl.so is taken from the same place; the one-sided HCCL functions from libhcomm.so when it
// exists there (CANN after January 2026), else from libhccl.so.
//
// A missing required symbol makes the whole table unavailable, with an error naming every missing
// symbol; a missing optional symbol leaves its pointer null and its feature off (features()).
// Nothing is called from static initialisers; load() is thread-safe and loads at most once per
// process (the result, success or failure, is kept).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "backends/ascend/ascend_min.h"
#include "core/status.h"

namespace pdlink::ascend {

struct AscendApi {
#define PDLINK_ACL_FN(fn) decltype(&::fn) fn = nullptr;
  // Required (ACL).
  PDLINK_ACL_FN(aclInit)
  PDLINK_ACL_FN(aclrtSetDevice)
  PDLINK_ACL_FN(aclrtGetDeviceCount)
  PDLINK_ACL_FN(aclrtGetCurrentContext)
  PDLINK_ACL_FN(aclrtSetCurrentContext)
  PDLINK_ACL_FN(aclrtCreateStream)
  PDLINK_ACL_FN(aclrtDestroyStream)
  PDLINK_ACL_FN(aclrtSynchronizeStream)
  PDLINK_ACL_FN(aclrtMalloc)
  PDLINK_ACL_FN(aclrtFree)
  PDLINK_ACL_FN(aclrtMallocHost)
  PDLINK_ACL_FN(aclrtFreeHost)
  PDLINK_ACL_FN(aclrtMemcpy)
  PDLINK_ACL_FN(aclrtMemcpyAsync)
  // Required (HCCL, two-sided point-to-point).
  PDLINK_ACL_FN(HcclGetRootInfo)
  PDLINK_ACL_FN(HcclCommInitRootInfo)
  PDLINK_ACL_FN(HcclCommDestroy)
  PDLINK_ACL_FN(HcclBatchSendRecv)
  // Optional.
  PDLINK_ACL_FN(aclGetRecentErrMsg)
  PDLINK_ACL_FN(aclrtSynchronizeStreamWithTimeout)  // feature "sync_timeout"
  PDLINK_ACL_FN(aclrtGetPhyDevIdByLogicDevId)
  PDLINK_ACL_FN(aclrtIpcMemGetExportKey)  // feature "ipc": these four together
  PDLINK_ACL_FN(aclrtIpcMemSetImportPid)
  PDLINK_ACL_FN(aclrtIpcMemImportByKey)
  PDLINK_ACL_FN(aclrtIpcMemClose)
  PDLINK_ACL_FN(HcclGetErrorString)
  PDLINK_ACL_FN(HcclGetCommAsyncError)
  PDLINK_ACL_FN(HcclRegisterGlobalMem)  // feature "one_sided": these seven together
  PDLINK_ACL_FN(HcclDeregisterGlobalMem)
  PDLINK_ACL_FN(HcclCommBindMem)
  PDLINK_ACL_FN(HcclCommUnbindMem)
  PDLINK_ACL_FN(HcclCommPrepare)
  PDLINK_ACL_FN(HcclBatchPut)
  PDLINK_ACL_FN(HcclBatchGet)
#undef PDLINK_ACL_FN

  std::string library_dir;                    // "" when found through the default loader path
  std::map<std::string, bool> features;       // "sync_timeout", "ipc", "one_sided", "error_text"
  std::vector<std::string> missing_optional;  // optional symbols the libraries lack

  // The process-wide table; kFeatureNotEnabled naming what is missing and where it looked.
  static Result<const AscendApi*> load();

  // The Status for a failed vendor call: code mapped by mapVendorCode, message naming the call,
  // the numeric code, its name and the runtime's own text.
  Status aclError(const char* call, int rc) const;
  Status hcclError(const char* call, int rc) const;
};

// The LLMStatusCode of a vendor return code: the one place that maps them (exposed for tests).
enum class Vendor { kAcl, kHccl };
Code mapVendorCode(Vendor vendor, int rc);

}  // namespace pdlink::ascend
