// The part of UCX's UCP API (ucp/api/ucp.h, ucs/type/status.h; API 1.x) that pdlink calls, declared
// here so that pdlink builds without UCX headers and loads libucp at run time (ucp_api.h).
//
// Only what pdlink uses is declared. UCP's parameter structs are read by the library only for the
// fields their field_mask names; each struct here declares the leading fields pdlink sets, in
// UCP's order and types, followed by zeroed reserve so that the library never reads past our
// object whatever its own definition adds. The layouts and constants are checked against the real
// headers by csrc/tests/ucx_abi_check.cc (built when UCX headers are found) and, behaviourally,
// by csrc/tests/ucx_test.cc against the real library.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pdlink::ucx {

// UCP's handle types, opaque here (ucp_context_h, ucp_config_t, ...).
using ucs_status_t = int;  // an enum of int values
using ucs_status_ptr_t = void*;
struct ucp_context;
using ucp_context_h = ucp_context*;
struct ucp_config_t;
struct ucp_worker;
using ucp_worker_h = ucp_worker*;
struct ucp_ep;
using ucp_ep_h = ucp_ep*;
struct ucp_address_t;
struct ucp_mem;
using ucp_mem_h = ucp_mem*;
struct ucp_rkey;
using ucp_rkey_h = ucp_rkey*;
using ucp_datatype_t = uint64_t;
extern "C" {
typedef void (*ucp_send_nbx_callback_t)(void* request, ucs_status_t status, void* user_data);
typedef void (*ucp_err_handler_cb_t)(void* arg, ucp_ep_h ep, ucs_status_t status);
typedef void (*ucp_am_recv_data_nbx_callback_t)(void* request, ucs_status_t status, size_t length, void* user_data);
}

// ucs_status_t values pdlink tells apart.
constexpr ucs_status_t kOk = 0;
constexpr ucs_status_t kInProgress = 1;
constexpr ucs_status_t kErrTimedOut = -20;
constexpr ucs_status_t kErrCanceled = -16;
constexpr ucs_status_t kErrUnreachable = -6;
constexpr ucs_status_t kErrConnectionReset = -25;
constexpr ucs_status_t kErrFirstLinkFailure = -40;
constexpr ucs_status_t kErrLastEndpointFailure = -89;
constexpr ucs_status_t kErrEndpointTimeout = -80;
constexpr ucs_status_t kErrLast = -100;

// UCS_PTR_IS_ERR / UCS_PTR_IS_PTR / UCS_PTR_STATUS.
inline bool ptrIsErr(ucs_status_ptr_t p) {
  return reinterpret_cast<uintptr_t>(p) >= static_cast<uintptr_t>(static_cast<intptr_t>(kErrLast));
}
inline bool ptrIsPtr(ucs_status_ptr_t p) {
  return reinterpret_cast<uintptr_t>(p) - 1 < static_cast<uintptr_t>(static_cast<intptr_t>(kErrLast)) - 1;
}
inline ucs_status_t ptrStatus(ucs_status_ptr_t p) {
  return ptrIsPtr(p) ? kInProgress : static_cast<ucs_status_t>(reinterpret_cast<intptr_t>(p));
}

// The UCP API version pdlink is written against (ucp_init_version's arguments).
constexpr unsigned kApiMajor = 1;
constexpr unsigned kApiMinor = 10;  // the oldest with every call used here (the *_nbx family)

constexpr uint64_t kParamFieldFeatures = 1ull << 0;
constexpr uint64_t kParamFieldMtWorkersShared = 1ull << 5;
constexpr uint64_t kFeatureRma = 1ull << 1;
constexpr uint64_t kFeatureWakeup = 1ull << 4;
constexpr uint64_t kFeatureAm = 1ull << 6;

constexpr uint64_t kWorkerParamFieldThreadMode = 1ull << 0;
constexpr int kThreadModeMulti = 2;  // UCS_THREAD_MODE_MULTI

constexpr uint64_t kWorkerAttrFieldAddress = 1ull << 1;
constexpr uint64_t kWorkerAttrFieldAddressFlags = 1ull << 2;
constexpr uint32_t kWorkerAddressFlagNetOnly = 1u << 0;

constexpr uint64_t kEpParamFieldRemoteAddress = 1ull << 0;
constexpr uint64_t kEpParamFieldErrHandlingMode = 1ull << 1;
constexpr uint64_t kEpParamFieldErrHandler = 1ull << 2;
constexpr int kErrHandlingModePeer = 1;  // UCP_ERR_HANDLING_MODE_PEER
constexpr uint32_t kEpCloseFlagForce = 1u << 0;
constexpr uint64_t kEpAttrFieldTransports = 1ull << 3;

constexpr uint64_t kMemMapParamFieldAddress = 1ull << 0;
constexpr uint64_t kMemMapParamFieldLength = 1ull << 1;
constexpr uint64_t kMemMapParamFieldProt = 1ull << 3;
constexpr unsigned kProtLocalRead = 1u << 0;
constexpr unsigned kProtLocalWrite = 1u << 1;
constexpr unsigned kProtRemoteRead = 1u << 8;
constexpr unsigned kProtRemoteWrite = 1u << 9;

constexpr uint32_t kOpAttrFieldCallback = 1u << 1;
constexpr uint32_t kOpAttrFieldUserData = 1u << 2;
constexpr uint32_t kOpAttrFieldFlags = 1u << 4;

constexpr uint64_t kAmHandlerParamFieldId = 1ull << 0;
constexpr uint64_t kAmHandlerParamFieldFlags = 1ull << 1;
constexpr uint64_t kAmHandlerParamFieldCb = 1ull << 2;
constexpr uint64_t kAmHandlerParamFieldArg = 1ull << 3;
constexpr uint64_t kAmRecvAttrFlagData = 1ull << 16;
constexpr uint64_t kAmRecvAttrFlagRndv = 1ull << 17;
constexpr uint32_t kAmSendFlagEager = 1u << 1;

// Zeroed space after the declared fields (see the file comment).
constexpr size_t kReserve = 256;

struct Params {  // ucp_params_t
  uint64_t field_mask = 0;
  uint64_t features = 0;
  size_t request_size = 0;
  void* request_init = nullptr;
  void* request_cleanup = nullptr;
  uint64_t tag_sender_mask = 0;
  int mt_workers_shared = 0;
  unsigned char reserve[kReserve] = {};
};

struct WorkerParams {  // ucp_worker_params_t
  uint64_t field_mask = 0;
  int thread_mode = 0;
  unsigned char reserve[kReserve] = {};
};

struct WorkerAttr {  // ucp_worker_attr_t
  uint64_t field_mask = 0;
  int thread_mode = 0;
  uint32_t address_flags = 0;
  ucp_address_t* address = nullptr;
  size_t address_length = 0;
  unsigned char reserve[kReserve] = {};
};

struct ErrHandler {  // ucp_err_handler_t
  ucp_err_handler_cb_t cb = nullptr;
  void* arg = nullptr;
};

struct EpParams {  // ucp_ep_params_t
  uint64_t field_mask = 0;
  const ucp_address_t* address = nullptr;
  int err_mode = 0;
  ErrHandler err_handler;
  unsigned char reserve[kReserve] = {};
};

struct TransportEntry {  // ucp_transport_entry_t
  const char* transport_name;
  const char* device_name;
};

struct Transports {  // ucp_transports_t
  TransportEntry* entries = nullptr;
  unsigned num_entries = 0;
  size_t entry_size = 0;
};

// ucp_ep_attr_t: UCX writes the fields field_mask names, so every field before the one pdlink
// reads is declared at its size (name, then two struct sockaddr_storage of 128 bytes).
struct EpAttr {
  uint64_t field_mask = 0;
  char name[32] = {};  // UCP_ENTITY_NAME_MAX
  alignas(8) unsigned char local_sockaddr[128] = {};
  alignas(8) unsigned char remote_sockaddr[128] = {};
  Transports transports;
  unsigned char reserve[kReserve] = {};
};

struct MemMapParams {  // ucp_mem_map_params_t
  uint64_t field_mask = 0;
  void* address = nullptr;
  size_t length = 0;
  unsigned flags = 0;
  unsigned prot = 0;
  unsigned char reserve[kReserve] = {};
};

struct RequestParam {  // ucp_request_param_t
  uint32_t op_attr_mask = 0;
  uint32_t flags = 0;
  void* request = nullptr;
  void* cb = nullptr;  // the callback union: a ucp_send_nbx_callback_t, ucp_am_recv_data_nbx_callback_t, ...
  ucp_datatype_t datatype = 0;
  void* user_data = nullptr;
  unsigned char reserve[kReserve] = {};
};

struct AmRecvParam {  // ucp_am_recv_param_t (UCX fills it)
  uint64_t recv_attr;
  ucp_ep_h reply_ep;
};

extern "C" {
typedef ucs_status_t (*ucp_am_recv_callback_t)(void* arg, const void* header, size_t header_length, void* data,
                                               size_t length, const AmRecvParam* param);
}

struct AmHandlerParam {  // ucp_am_handler_param_t
  uint64_t field_mask = 0;
  unsigned id = 0;
  uint32_t flags = 0;
  ucp_am_recv_callback_t cb = nullptr;
  void* arg = nullptr;
  unsigned char reserve[kReserve] = {};
};

// The functions, as libucp exports them (parameter structs through pdlink's prefix types): the
// types of UcpApi's pointers (ucp_api.h).
extern "C" {
using ucp_config_read_t = ucs_status_t (*)(const char* env_prefix, const char* filename, ucp_config_t** config_p);
using ucp_config_release_t = void (*)(ucp_config_t* config);
using ucp_config_modify_t = ucs_status_t (*)(ucp_config_t* config, const char* name, const char* value);
using ucp_get_version_t = void (*)(unsigned* major_version, unsigned* minor_version, unsigned* release_number);
using ucp_init_version_t = ucs_status_t (*)(unsigned api_major_version, unsigned api_minor_version,
                                            const Params* params, const ucp_config_t* config, ucp_context_h* context_p);
using ucp_cleanup_t = void (*)(ucp_context_h context_p);
using ucp_worker_create_t = ucs_status_t (*)(ucp_context_h context, const WorkerParams* params, ucp_worker_h* worker_p);
using ucp_worker_destroy_t = void (*)(ucp_worker_h worker);
using ucp_worker_query_t = ucs_status_t (*)(ucp_worker_h worker, WorkerAttr* attr);
using ucp_worker_release_address_t = void (*)(ucp_worker_h worker, ucp_address_t* address);
using ucp_worker_progress_t = unsigned (*)(ucp_worker_h worker);
using ucp_worker_get_efd_t = ucs_status_t (*)(ucp_worker_h worker, int* fd);
using ucp_worker_arm_t = ucs_status_t (*)(ucp_worker_h worker);
using ucp_worker_signal_t = ucs_status_t (*)(ucp_worker_h worker);
using ucp_ep_create_t = ucs_status_t (*)(ucp_worker_h worker, const EpParams* params, ucp_ep_h* ep_p);
using ucp_ep_close_nbx_t = ucs_status_ptr_t (*)(ucp_ep_h ep, const RequestParam* param);
using ucp_ep_flush_nbx_t = ucs_status_ptr_t (*)(ucp_ep_h ep, const RequestParam* param);
using ucp_ep_query_t = ucs_status_t (*)(ucp_ep_h ep, EpAttr* attr);
using ucp_mem_map_t = ucs_status_t (*)(ucp_context_h context, const MemMapParams* params, ucp_mem_h* memh_p);
using ucp_mem_unmap_t = ucs_status_t (*)(ucp_context_h context, ucp_mem_h memh);
using ucp_rkey_pack_t = ucs_status_t (*)(ucp_context_h context, ucp_mem_h memh, void** rkey_buffer_p, size_t* size_p);
using ucp_rkey_buffer_release_t = void (*)(void* rkey_buffer);
using ucp_ep_rkey_unpack_t = ucs_status_t (*)(ucp_ep_h ep, const void* rkey_buffer, ucp_rkey_h* rkey_p);
using ucp_rkey_destroy_t = void (*)(ucp_rkey_h rkey);
using ucp_get_nbx_t = ucs_status_ptr_t (*)(ucp_ep_h ep, void* buffer, size_t count, uint64_t remote_addr,
                                           ucp_rkey_h rkey, const RequestParam* param);
using ucp_put_nbx_t = ucs_status_ptr_t (*)(ucp_ep_h ep, const void* buffer, size_t count, uint64_t remote_addr,
                                           ucp_rkey_h rkey, const RequestParam* param);
using ucp_worker_set_am_recv_handler_t = ucs_status_t (*)(ucp_worker_h worker, const AmHandlerParam* param);
using ucp_am_send_nbx_t = ucs_status_ptr_t (*)(ucp_ep_h ep, unsigned id, const void* header, size_t header_length,
                                               const void* buffer, size_t count, const RequestParam* param);
using ucp_am_recv_data_nbx_t = ucs_status_ptr_t (*)(ucp_worker_h worker, void* data_desc, void* buffer, size_t count,
                                                    const RequestParam* param);
using ucp_am_data_release_t = void (*)(ucp_worker_h worker, void* data);
using ucp_request_check_status_t = ucs_status_t (*)(void* request);
using ucp_request_cancel_t = void (*)(ucp_worker_h worker, void* request);
using ucp_request_free_t = void (*)(void* request);
using ucs_status_string_t = const char* (*)(ucs_status_t status);
}  // extern "C"

}  // namespace pdlink::ucx
