// Loading libucp into UcpApi (transport/ucx/ucp_api.h), and UCX statuses as pdlink Statuses.
#include "transport/ucx/ucp_api.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <mutex>
#include <vector>

#include "core/environment.h"

namespace pdlink::ucx {
namespace {

constexpr const char* kSoname = "libucp.so.0";

std::mutex g_dir_mu;
std::string g_wheel_dir;  // guarded by g_dir_mu

bool isFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

template <class F>
void bind(void* lib, const char* name, F* slot, std::vector<std::string>* missing) {
  void* sym = ::dlsym(lib, name);
  if (sym) {
    *slot = reinterpret_cast<F>(sym);
  } else {
    missing->push_back(name);
  }
}

// loadOnce's steps. Where to look for libucp: PDLINK_UCX_LIB_DIR (which must hold it), else the
// libucx wheel's directory where it has it, then the loader's search path.
Status libraryCandidates(std::vector<std::string>* candidates) {
  const std::optional<std::string> dir = environment::read(environment::kUcxLibDir);
  const char* env = dir ? dir->c_str() : nullptr;
  if (env != nullptr && *env != '\0') {
    std::string path = std::string(env) + "/" + kSoname;
    if (!isFile(path)) {
      return Status(Code::kFeatureNotEnabled, "ucx unavailable: PDLINK_UCX_LIB_DIR=" + std::string(env) + " has no " +
                                                  kSoname +
                                                  "; point it at UCX's lib directory, or "
                                                  "unset it to use the libucx package or the system's UCX");
    }
    candidates->push_back(path);
  } else {
    {
      std::lock_guard<std::mutex> lock(g_dir_mu);
      if (!g_wheel_dir.empty() && isFile(g_wheel_dir + "/" + kSoname))
        candidates->push_back(g_wheel_dir + "/" + kSoname);
    }
    candidates->push_back(kSoname);
  }
  return Status::OK();
}

// The first candidate dlopen takes (*loaded: its path).
Result<void*> openLibrary(const std::vector<std::string>& candidates, std::string* loaded) {
  void* lib = nullptr;
  std::vector<std::string> errors;
  for (const std::string& path : candidates) {
    lib = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) {
      *loaded = path;
      break;
    }
    const char* e = ::dlerror();
    errors.push_back(e ? e : path + ": dlopen failed");
  }
  if (lib == nullptr) {
    return Status(Code::kFeatureNotEnabled,
                  "ucx unavailable: cannot load " + std::string(kSoname) + " (" + join(errors) +
                      "). Install pdlink's ucx extra (pip install \"pdlink[ucx]\", the libucx-cu12 wheel) or the "
                      "system's UCX (Debian: libucx0), or set PDLINK_UCX_LIB_DIR");
  }
  return lib;
}

// Every symbol pdlink needs (*missing: those the library lacks).
void bindAll(void* lib, UcpApi* api, std::vector<std::string>* missing) {
#define PDLINK_BIND(fn) bind(lib, #fn, &api->fn, missing)
  PDLINK_BIND(ucp_config_read);
  PDLINK_BIND(ucp_config_release);
  PDLINK_BIND(ucp_config_modify);
  PDLINK_BIND(ucp_get_version);
  PDLINK_BIND(ucp_init_version);
  PDLINK_BIND(ucp_cleanup);
  PDLINK_BIND(ucp_worker_create);
  PDLINK_BIND(ucp_worker_destroy);
  PDLINK_BIND(ucp_worker_query);
  PDLINK_BIND(ucp_worker_release_address);
  PDLINK_BIND(ucp_worker_progress);
  PDLINK_BIND(ucp_worker_get_efd);
  PDLINK_BIND(ucp_worker_arm);
  PDLINK_BIND(ucp_worker_signal);
  PDLINK_BIND(ucp_ep_create);
  PDLINK_BIND(ucp_ep_close_nbx);
  PDLINK_BIND(ucp_ep_flush_nbx);
  PDLINK_BIND(ucp_mem_map);
  PDLINK_BIND(ucp_mem_unmap);
  PDLINK_BIND(ucp_rkey_pack);
  PDLINK_BIND(ucp_rkey_buffer_release);
  PDLINK_BIND(ucp_ep_rkey_unpack);
  PDLINK_BIND(ucp_rkey_destroy);
  PDLINK_BIND(ucp_get_nbx);
  PDLINK_BIND(ucp_put_nbx);
  PDLINK_BIND(ucp_worker_set_am_recv_handler);
  PDLINK_BIND(ucp_am_send_nbx);
  PDLINK_BIND(ucp_am_recv_data_nbx);
  PDLINK_BIND(ucp_am_data_release);
  PDLINK_BIND(ucp_request_check_status);
  PDLINK_BIND(ucp_request_cancel);
  PDLINK_BIND(ucp_request_free);
  PDLINK_BIND(ucs_status_string);  // libucs, reached through libucp's dependencies
#undef PDLINK_BIND
}

Result<const UcpApi*> loadOnce() {
  std::vector<std::string> candidates;  // paths for dlopen; a bare soname searches the loader path
  PDLINK_RETURN_IF_ERROR(libraryCandidates(&candidates));
  std::string loaded;
  Result<void*> opened = openLibrary(candidates, &loaded);
  if (!opened.ok()) return opened.status();
  void* lib = opened.value();
  // The library stays loaded for the process, even when it is refused below: its constructors have
  // run (libucm may have hooked the allocator), so unloading it could leave those hooks dangling.
  auto* api = new UcpApi();
  std::vector<std::string> missing;
  bindAll(lib, api, &missing);
  std::vector<std::string> optional_missing;
  bind(lib, "ucp_ep_query", &api->ucp_ep_query, &optional_missing);
  if (!missing.empty()) {
    delete api;
    return Status(Code::kFeatureNotEnabled, "ucx unavailable: " + loaded + " lacks " + join(missing) + " (UCX 1." +
                                                std::to_string(kApiMinor) + " or newer is needed)");
  }
  unsigned major = 0, minor = 0, release = 0;
  api->ucp_get_version(&major, &minor, &release);
  if (major != kApiMajor || minor < kApiMinor) {
    std::string found = std::to_string(major) + "." + std::to_string(minor);
    delete api;
    return Status(Code::kFeatureNotEnabled, "ucx unavailable: " + loaded + " is UCX " + found +
                                                "; pdlink needs UCX 1." + std::to_string(kApiMinor) + " or newer");
  }
  Dl_info info{};
  api->library =
      ::dladdr(reinterpret_cast<void*>(api->ucp_init_version), &info) && info.dli_fname ? info.dli_fname : loaded;
  api->version = std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(release);
  api->minor = minor;
  return static_cast<const UcpApi*>(api);
}

}  // namespace

void setWheelLibDir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(g_dir_mu);
  g_wheel_dir = dir;
}

Result<const UcpApi*> load() {
  static const Result<const UcpApi*> loaded = loadOnce();  // thread-safe, once
  return loaded;
}

std::string statusText(ucs_status_t status) {
  Result<const UcpApi*> api = load();
  const char* text = api.ok() ? api.value()->ucs_status_string(status) : nullptr;
  return std::string(text ? text : "UCX error") + " (" + std::to_string(status) + ")";
}

Status toStatus(ucs_status_t status, const std::string& what) {
  Code code = Code::kFailed;
  if (status == kErrTimedOut || status == kErrEndpointTimeout) {
    code = Code::kTimeout;
  } else if (status == kErrUnreachable || status == kErrConnectionReset || status == kErrCanceled ||
             (status <= kErrFirstLinkFailure && status >= kErrLastEndpointFailure)) {
    code = Code::kLinkFailed;
  }
  return Status(code, what + ": " + statusText(status));
}

}  // namespace pdlink::ucx
