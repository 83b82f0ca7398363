// UcpApi: the one symbol table through which pdlink calls UCX's UCP (transport/ucx/ucp_min.h).
//
// libucp is loaded at run time with dlopen (RTLD_NOW | RTLD_LOCAL): pdlink builds and imports
// without UCX, and the ucx data path is offered only where the library loads. Search order for
// libucp.so.0:
//   1. $PDLINK_UCX_LIB_DIR (when set, the library must be there: no fallback),
//   2. the directory set by setWheelLibDir (pdlink's Python layer passes the lib/ folder of the
//      `libucx` package, which `pip install "pdlink[ucx]"` installs), when set,
//   3. the dynamic loader's default path (Debian's libucx0, LD_LIBRARY_PATH).
// libucp finds its own libucs/libuct and transport modules beside itself.
//
// A missing symbol makes the whole table unavailable, with an error naming every missing symbol.
// Nothing is called from static initialisers; load() is thread-safe and loads at most once per
// process (the result, success or failure, is kept): setWheelLibDir after it has no effect.
#pragma once

#include <string>

#include "core/status.h"
#include "transport/ucx/ucp_min.h"

namespace pdlink::ucx {

// The RMA calls (ucp_mem_map .. ucp_put_nbx) are bound for ucx_test's proof of why pdlink's
// workers never enable UCP_FEATURE_RMA (docs/ucx.md, "Trust"); pdlink itself does not call them.
struct UcpApi {
#define PDLINK_UCP_FN(fn) fn##_t fn = nullptr;
  PDLINK_UCP_FN(ucp_config_read)
  PDLINK_UCP_FN(ucp_config_release)
  PDLINK_UCP_FN(ucp_config_modify)
  PDLINK_UCP_FN(ucp_get_version)
  PDLINK_UCP_FN(ucp_init_version)
  PDLINK_UCP_FN(ucp_cleanup)
  PDLINK_UCP_FN(ucp_worker_create)
  PDLINK_UCP_FN(ucp_worker_destroy)
  PDLINK_UCP_FN(ucp_worker_query)
  PDLINK_UCP_FN(ucp_worker_release_address)
  PDLINK_UCP_FN(ucp_worker_progress)
  PDLINK_UCP_FN(ucp_worker_get_efd)
  PDLINK_UCP_FN(ucp_worker_arm)
  PDLINK_UCP_FN(ucp_worker_signal)
  PDLINK_UCP_FN(ucp_ep_create)
  PDLINK_UCP_FN(ucp_ep_close_nbx)
  PDLINK_UCP_FN(ucp_ep_flush_nbx)
  PDLINK_UCP_FN(ucp_mem_map)
  PDLINK_UCP_FN(ucp_mem_unmap)
  PDLINK_UCP_FN(ucp_rkey_pack)
  PDLINK_UCP_FN(ucp_rkey_buffer_release)
  PDLINK_UCP_FN(ucp_ep_rkey_unpack)
  PDLINK_UCP_FN(ucp_rkey_destroy)
  PDLINK_UCP_FN(ucp_get_nbx)
  PDLINK_UCP_FN(ucp_put_nbx)
  PDLINK_UCP_FN(ucp_worker_set_am_recv_handler)
  PDLINK_UCP_FN(ucp_am_send_nbx)
  PDLINK_UCP_FN(ucp_am_recv_data_nbx)
  PDLINK_UCP_FN(ucp_am_data_release)
  PDLINK_UCP_FN(ucp_request_check_status)
  PDLINK_UCP_FN(ucp_request_cancel)
  PDLINK_UCP_FN(ucp_request_free)
  PDLINK_UCP_FN(ucs_status_string)
#undef PDLINK_UCP_FN

  // Optional: bound where the library has it, else null; endpoints then
  // cannot name their transports.
  ucp_ep_query_t ucp_ep_query = nullptr;

  std::string library;  // the path dlopen loaded
  std::string version;  // "major.minor.release" (ucp_get_version)
  unsigned minor = 0;   // its minor
};

// Where to look for libucp after $PDLINK_UCX_LIB_DIR (see the file comment). Thread-safe.
void setWheelLibDir(const std::string& dir);

// The loaded table, or why there is none (kFeatureNotEnabled, naming what to install or set).
// Thread-safe; the first call loads.
Result<const UcpApi*> load();

// A UCX status as text ("Connection reset by remote peer (-25)"); needs the table loaded.
std::string statusText(ucs_status_t status);

// A UCX failure as a pdlink Status: peer and transport failures (unreachable, connection reset,
// link and endpoint failures) are kLinkFailed, UCX's own timeouts kTimeout, the rest kFailed;
// the message names `what` and UCX's text.
Status toStatus(ucs_status_t status, const std::string& what);

}  // namespace pdlink::ucx
