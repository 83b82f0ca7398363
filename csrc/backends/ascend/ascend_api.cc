// Loading the Ascend runtime libraries into AscendApi, and mapping their codes to LLMStatusCode.
#include "backends/ascend/ascend_api.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <mutex>
#include <sstream>

#include "core/environment.h"
#include "core/log.h"

namespace pdlink::ascend {
namespace {

bool isFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string envOr(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

// Where libascendcl.so is: a directory, "" for the default loader path, or an error.
Result<std::string> findLibraryDir(std::vector<std::string>* searched) {
  std::string explicit_dir = environment::read(environment::kAscendLibDir).value_or("");
  if (!explicit_dir.empty()) {
    searched->push_back(explicit_dir);
    if (isFile(explicit_dir + "/libascendcl.so")) return explicit_dir;
    return Status(Code::kFeatureNotEnabled,
                  "PDLINK_ASCEND_LIB_DIR=" + explicit_dir +
                      " has no libascendcl.so; point it at the CANN lib64 "
                      "directory, or unset it to search $ASCEND_HOME_PATH, $ASCEND_TOOLKIT_HOME and the loader path");
  }
  for (const char* var : {"ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"}) {
    std::string home = envOr(var);
    if (home.empty()) continue;
    std::string dir = home + "/lib64";
    searched->push_back(dir);
    if (isFile(dir + "/libascendcl.so")) return dir;
  }
  searched->push_back("the dynamic loader's default path");
  return std::string();
}

void* openLib(const std::string& dir, const char* soname, std::string* error) {
  std::string path = dir.empty() ? soname : dir + "/" + soname;
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = ::dlerror();
    *error = e ? e : "dlopen failed";
  }
  return h;
}

template <class F>
void bind(void* lib, const char* name, F* slot, std::vector<std::string>* missing) {
  ::dlerror();
  void* sym = lib ? ::dlsym(lib, name) : nullptr;
  if (sym) {
    *slot = reinterpret_cast<F>(sym);
  } else {
    missing->push_back(name);
  }
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

Result<const AscendApi*> loadOnce() {
  std::vector<std::string> searched;
  auto dir_r = findLibraryDir(&searched);
  if (!dir_r.ok()) return dir_r.status();
  const std::string dir = dir_r.value();
  std::string err;
  void* acl = openLib(dir, "libascendcl.so", &err);
  if (!acl) {
    return Status(Code::kFeatureNotEnabled, "Ascend backend unavailable: cannot load libascendcl.so (" + err +
                                                "); searched " + join(searched) +
                                                ". Install CANN and source set_env.sh, or set PDLINK_ASCEND_LIB_DIR");
  }
  void* hccl = openLib(dir, "libhccl.so", &err);
  if (!hccl) {
    return Status(Code::kFeatureNotEnabled,
                  "Ascend backend unavailable: cannot load libhccl.so (" + err + ") next to libascendcl.so");
  }
  std::string ignored;
  void* hcomm = openLib(dir, "libhcomm.so", &ignored);  // optional; one-sided API on new CANN

  auto* api = new AscendApi();  // lives for the process: the libraries are never unloaded
  api->library_dir = dir;
  std::vector<std::string> missing;
#define PDLINK_BIND(lib, fn) bind(lib, #fn, &api->fn, &missing)
  PDLINK_BIND(acl, aclInit);
  PDLINK_BIND(acl, aclrtSetDevice);
  PDLINK_BIND(acl, aclrtGetDeviceCount);
  PDLINK_BIND(acl, aclrtGetCurrentContext);
  PDLINK_BIND(acl, aclrtSetCurrentContext);
  PDLINK_BIND(acl, aclrtCreateStream);
  PDLINK_BIND(acl, aclrtDestroyStream);
  PDLINK_BIND(acl, aclrtSynchronizeStream);
  PDLINK_BIND(acl, aclrtMalloc);
  PDLINK_BIND(acl, aclrtFree);
  PDLINK_BIND(acl, aclrtMallocHost);
  PDLINK_BIND(acl, aclrtFreeHost);
  PDLINK_BIND(acl, aclrtMemcpy);
  PDLINK_BIND(acl, aclrtMemcpyAsync);
  PDLINK_BIND(hccl, HcclGetRootInfo);
  PDLINK_BIND(hccl, HcclCommInitRootInfo);
  PDLINK_BIND(hccl, HcclCommDestroy);
  PDLINK_BIND(hccl, HcclBatchSendRecv);
  if (!missing.empty()) {
    delete api;
    return Status(Code::kFeatureNotEnabled, "Ascend backend unavailable: the runtime libraries in " +
                                                (dir.empty() ? std::string("the loader path") : dir) +
                                                " lack required symbols: " + join(missing) +
                                                " (CANN too old, or not CANN's libraries)");
  }
  // Optional symbols come in groups; a group's feature is on only when all of its symbols exist.
  auto endGroup = [&](const char* feature) {
    if (feature) api->features[feature] = missing.empty();
    api->missing_optional.insert(api->missing_optional.end(), missing.begin(), missing.end());
    missing.clear();
  };
  PDLINK_BIND(acl, aclGetRecentErrMsg);
  endGroup("error_text");
  PDLINK_BIND(acl, aclrtGetPhyDevIdByLogicDevId);
  PDLINK_BIND(hccl, HcclGetErrorString);
  PDLINK_BIND(hccl, HcclGetCommAsyncError);
  endGroup(nullptr);
  PDLINK_BIND(acl, aclrtSynchronizeStreamWithTimeout);
  endGroup("sync_timeout");
  PDLINK_BIND(acl, aclrtIpcMemGetExportKey);
  PDLINK_BIND(acl, aclrtIpcMemSetImportPid);
  PDLINK_BIND(acl, aclrtIpcMemImportByKey);
  PDLINK_BIND(acl, aclrtIpcMemClose);
  endGroup("ipc");
  void* one_sided = hcomm ? hcomm : hccl;
  PDLINK_BIND(one_sided, HcclRegisterGlobalMem);
  PDLINK_BIND(one_sided, HcclDeregisterGlobalMem);
  PDLINK_BIND(one_sided, HcclCommBindMem);
  PDLINK_BIND(one_sided, HcclCommUnbindMem);
  PDLINK_BIND(one_sided, HcclCommPrepare);
  PDLINK_BIND(one_sided, HcclBatchPut);
  PDLINK_BIND(one_sided, HcclBatchGet);
  endGroup("one_sided");
#undef PDLINK_BIND
  if (!api->missing_optional.empty()) {
    PDLINK_LOG(kInfo, "Ascend runtime lacks optional symbols (features off): " << join(api->missing_optional));
  }
  return static_cast<const AscendApi*>(api);
}

const char* aclCodeName(int rc) {
  switch (rc) {
    case ACL_SUCCESS:
      return "ACL_SUCCESS";
    case ACL_ERROR_INVALID_PARAM:
      return "ACL_ERROR_INVALID_PARAM";
    case ACL_ERROR_UNINITIALIZE:
      return "ACL_ERROR_UNINITIALIZE";
    case ACL_ERROR_REPEAT_INITIALIZE:
      return "ACL_ERROR_REPEAT_INITIALIZE";
    case ACL_ERROR_BAD_ALLOC:
      return "ACL_ERROR_BAD_ALLOC";
    case ACL_ERROR_INVALID_DEVICE:
      return "ACL_ERROR_INVALID_DEVICE";
    case ACL_ERROR_RT_PARAM_INVALID:
      return "ACL_ERROR_RT_PARAM_INVALID";
    case ACL_ERROR_RT_INVALID_DEVICEID:
      return "ACL_ERROR_RT_INVALID_DEVICEID";
    case ACL_ERROR_RT_CONTEXT_NULL:
      return "ACL_ERROR_RT_CONTEXT_NULL";
    case ACL_ERROR_RT_WAIT_TIMEOUT:
      return "ACL_ERROR_RT_WAIT_TIMEOUT";
    case ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
      return "ACL_ERROR_RT_FEATURE_NOT_SUPPORT";
    case ACL_ERROR_RT_MEMORY_ALLOCATION:
      return "ACL_ERROR_RT_MEMORY_ALLOCATION";
    case ACL_ERROR_RT_NO_DEVICE:
      return "ACL_ERROR_RT_NO_DEVICE";
    case ACL_ERROR_RT_NO_PERMISSION:
      return "ACL_ERROR_RT_NO_PERMISSION";
    case ACL_ERROR_RT_DEVICE_OOM:
      return "ACL_ERROR_RT_DEVICE_OOM";
    case ACL_ERROR_RT_INTERNAL_ERROR:
      return "ACL_ERROR_RT_INTERNAL_ERROR";
    case ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
      return "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT";
    case ACL_ERROR_RT_EVENT_SYNC_TIMEOUT:
      return "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT";
    default:
      return "ACL error";
  }
}

const char* hcclCodeName(int rc) {
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
  return rc >= 0 && rc < static_cast<int>(sizeof(kNames) / sizeof(kNames[0])) ? kNames[rc] : "HCCL error";
}

}  // namespace

Result<const AscendApi*> AscendApi::load() {
  static std::once_flag once;
  static Result<const AscendApi*>* result = nullptr;
  std::call_once(once, [] { result = new Result<const AscendApi*>(loadOnce()); });
  return *result;
}

Code mapVendorCode(Vendor vendor, int rc) {
  if (vendor == Vendor::kAcl) {
    switch (rc) {
      case ACL_SUCCESS:
        return Code::kSuccess;
      case ACL_ERROR_INVALID_PARAM:
      case ACL_ERROR_RT_PARAM_INVALID:
      case ACL_ERROR_INVALID_DEVICE:
      case ACL_ERROR_RT_INVALID_DEVICEID:
        return Code::kParamInvalid;
      case ACL_ERROR_BAD_ALLOC:
      case ACL_ERROR_RT_MEMORY_ALLOCATION:
      case ACL_ERROR_RT_DEVICE_OOM:
        return Code::kDeviceOutOfMemory;
      case ACL_ERROR_RT_WAIT_TIMEOUT:
      case ACL_ERROR_RT_STREAM_SYNC_TIMEOUT:
      case ACL_ERROR_RT_EVENT_SYNC_TIMEOUT:
        return Code::kTimeout;
      case ACL_ERROR_API_NOT_SUPPORT:
      case ACL_ERROR_FEATURE_UNSUPPORTED:
      case ACL_ERROR_RT_FEATURE_NOT_SUPPORT:
        return Code::kFeatureNotEnabled;
      default:
        return Code::kFailed;
    }
  }
  switch (rc) {
    case HCCL_SUCCESS:
      return Code::kSuccess;
    case HCCL_E_PARA:
    case HCCL_E_PTR:
      return Code::kParamInvalid;
    case HCCL_E_TIMEOUT:
      return Code::kTimeout;
    case HCCL_E_MEMORY:
    case HCCL_E_OOM:
      return Code::kDeviceOutOfMemory;
    case HCCL_E_NOT_SUPPORT:
      return Code::kFeatureNotEnabled;
    case HCCL_E_TCP_CONNECT:
    case HCCL_E_ROCE_CONNECT:
    case HCCL_E_TCP_TRANSFER:
    case HCCL_E_ROCE_TRANSFER:
    case HCCL_E_NETWORK:
    case HCCL_E_REMOTE:
      return Code::kLinkFailed;
    default:
      return Code::kFailed;
  }
}

Status AscendApi::aclError(const char* call, int rc) const {
  std::ostringstream m;
  m << call << " failed: " << aclCodeName(rc) << " (" << rc << ")";
  const char* text = aclGetRecentErrMsg ? aclGetRecentErrMsg() : nullptr;
  if (text && *text) m << ": " << text;
  return Status(mapVendorCode(Vendor::kAcl, rc), m.str());
}

Status AscendApi::hcclError(const char* call, int rc) const {
  std::ostringstream m;
  m << call << " failed: " << hcclCodeName(rc) << " (" << rc << ")";
  return Status(mapVendorCode(Vendor::kHccl, rc), m.str());
}

}  // namespace pdlink::ascend
