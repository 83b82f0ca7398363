// Compile-time check of transport/ucx/ucp_min.h against UCX's own headers: every constant pdlink
// declares equals UCX's, and every field pdlink sets sits at UCX's offset. Built only where UCX
// headers are found (-DPDLINK_UCX_INCLUDE_DIR=<dir>, which .ci/ucx.sh passes: the libucx wheel's
// include/); compiling is the check, and the program only says so.
#include <ucp/api/ucp.h>

#include <cstddef>
#include <cstdio>

#include "transport/ucx/ucp_min.h"

namespace u = pdlink::ucx;

#define SAME(ours, theirs) static_assert(static_cast<long long>(ours) == static_cast<long long>(theirs), #ours)
#define AT(ours, theirs, field) static_assert(offsetof(u::ours, field) == offsetof(theirs, field), #ours "::" #field)

SAME(u::kOk, UCS_OK);
SAME(u::kInProgress, UCS_INPROGRESS);
SAME(u::kErrTimedOut, UCS_ERR_TIMED_OUT);
SAME(u::kErrCanceled, UCS_ERR_CANCELED);
SAME(u::kErrUnreachable, UCS_ERR_UNREACHABLE);
SAME(u::kErrConnectionReset, UCS_ERR_CONNECTION_RESET);
SAME(u::kErrFirstLinkFailure, UCS_ERR_FIRST_LINK_FAILURE);
SAME(u::kErrLastEndpointFailure, UCS_ERR_LAST_ENDPOINT_FAILURE);
SAME(u::kErrEndpointTimeout, UCS_ERR_ENDPOINT_TIMEOUT);
SAME(u::kErrLast, UCS_ERR_LAST);
SAME(u::kParamFieldFeatures, UCP_PARAM_FIELD_FEATURES);
SAME(u::kParamFieldMtWorkersShared, UCP_PARAM_FIELD_MT_WORKERS_SHARED);
SAME(u::kFeatureRma, UCP_FEATURE_RMA);
SAME(u::kFeatureWakeup, UCP_FEATURE_WAKEUP);
SAME(u::kWorkerParamFieldThreadMode, UCP_WORKER_PARAM_FIELD_THREAD_MODE);
SAME(u::kThreadModeMulti, UCS_THREAD_MODE_MULTI);
SAME(u::kWorkerAttrFieldAddress, UCP_WORKER_ATTR_FIELD_ADDRESS);
SAME(u::kWorkerAttrFieldAddressFlags, UCP_WORKER_ATTR_FIELD_ADDRESS_FLAGS);
SAME(u::kWorkerAddressFlagNetOnly, UCP_WORKER_ADDRESS_FLAG_NET_ONLY);
SAME(u::kEpParamFieldRemoteAddress, UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
SAME(u::kEpParamFieldErrHandlingMode, UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
SAME(u::kEpParamFieldErrHandler, UCP_EP_PARAM_FIELD_ERR_HANDLER);
SAME(u::kErrHandlingModePeer, UCP_ERR_HANDLING_MODE_PEER);
SAME(u::kEpCloseFlagForce, UCP_EP_CLOSE_FLAG_FORCE);
SAME(u::kEpAttrFieldTransports, UCP_EP_ATTR_FIELD_TRANSPORTS);
SAME(u::kMemMapParamFieldAddress, UCP_MEM_MAP_PARAM_FIELD_ADDRESS);
SAME(u::kMemMapParamFieldLength, UCP_MEM_MAP_PARAM_FIELD_LENGTH);
SAME(u::kMemMapParamFieldProt, UCP_MEM_MAP_PARAM_FIELD_PROT);
SAME(u::kProtLocalRead, UCP_MEM_MAP_PROT_LOCAL_READ);
SAME(u::kProtLocalWrite, UCP_MEM_MAP_PROT_LOCAL_WRITE);
SAME(u::kProtRemoteRead, UCP_MEM_MAP_PROT_REMOTE_READ);
SAME(u::kProtRemoteWrite, UCP_MEM_MAP_PROT_REMOTE_WRITE);
SAME(u::kOpAttrFieldCallback, UCP_OP_ATTR_FIELD_CALLBACK);
SAME(u::kOpAttrFieldUserData, UCP_OP_ATTR_FIELD_USER_DATA);
SAME(u::kOpAttrFieldFlags, UCP_OP_ATTR_FIELD_FLAGS);
SAME(u::kFeatureAm, UCP_FEATURE_AM);
SAME(u::kAmHandlerParamFieldId, UCP_AM_HANDLER_PARAM_FIELD_ID);
SAME(u::kAmHandlerParamFieldFlags, UCP_AM_HANDLER_PARAM_FIELD_FLAGS);
SAME(u::kAmHandlerParamFieldCb, UCP_AM_HANDLER_PARAM_FIELD_CB);
SAME(u::kAmHandlerParamFieldArg, UCP_AM_HANDLER_PARAM_FIELD_ARG);
SAME(u::kAmRecvAttrFlagData, UCP_AM_RECV_ATTR_FLAG_DATA);
SAME(u::kAmRecvAttrFlagRndv, UCP_AM_RECV_ATTR_FLAG_RNDV);
SAME(u::kAmSendFlagEager, UCP_AM_SEND_FLAG_EAGER);

AT(Params, ucp_params_t, field_mask);
AT(Params, ucp_params_t, features);
AT(Params, ucp_params_t, request_size);
AT(Params, ucp_params_t, request_init);
AT(Params, ucp_params_t, request_cleanup);
AT(Params, ucp_params_t, tag_sender_mask);
AT(Params, ucp_params_t, mt_workers_shared);
AT(WorkerParams, ucp_worker_params_t, field_mask);
AT(WorkerParams, ucp_worker_params_t, thread_mode);
AT(WorkerAttr, ucp_worker_attr_t, field_mask);
AT(WorkerAttr, ucp_worker_attr_t, thread_mode);
AT(WorkerAttr, ucp_worker_attr_t, address_flags);
AT(WorkerAttr, ucp_worker_attr_t, address);
AT(WorkerAttr, ucp_worker_attr_t, address_length);
AT(EpParams, ucp_ep_params_t, field_mask);
AT(EpParams, ucp_ep_params_t, address);
AT(EpParams, ucp_ep_params_t, err_mode);
AT(EpParams, ucp_ep_params_t, err_handler);
AT(EpAttr, ucp_ep_attr_t, field_mask);
AT(EpAttr, ucp_ep_attr_t, name);
AT(EpAttr, ucp_ep_attr_t, local_sockaddr);
AT(EpAttr, ucp_ep_attr_t, remote_sockaddr);
AT(EpAttr, ucp_ep_attr_t, transports);
AT(Transports, ucp_transports_t, entries);
AT(Transports, ucp_transports_t, num_entries);
AT(Transports, ucp_transports_t, entry_size);
AT(TransportEntry, ucp_transport_entry_t, transport_name);
AT(TransportEntry, ucp_transport_entry_t, device_name);
static_assert(sizeof(u::TransportEntry) == sizeof(ucp_transport_entry_t), "ucp_transport_entry_t");
AT(MemMapParams, ucp_mem_map_params_t, field_mask);
AT(MemMapParams, ucp_mem_map_params_t, address);
AT(MemMapParams, ucp_mem_map_params_t, length);
AT(MemMapParams, ucp_mem_map_params_t, flags);
AT(MemMapParams, ucp_mem_map_params_t, prot);
AT(RequestParam, ucp_request_param_t, op_attr_mask);
AT(RequestParam, ucp_request_param_t, flags);
AT(RequestParam, ucp_request_param_t, request);
AT(RequestParam, ucp_request_param_t, datatype);
AT(RequestParam, ucp_request_param_t, user_data);
static_assert(offsetof(u::RequestParam, cb) == offsetof(ucp_request_param_t, cb), "RequestParam::cb");
AT(AmHandlerParam, ucp_am_handler_param_t, field_mask);
AT(AmHandlerParam, ucp_am_handler_param_t, id);
AT(AmHandlerParam, ucp_am_handler_param_t, flags);
AT(AmHandlerParam, ucp_am_handler_param_t, cb);
AT(AmHandlerParam, ucp_am_handler_param_t, arg);
static_assert(sizeof(u::AmHandlerParam) >= sizeof(ucp_am_handler_param_t), "AmHandlerParam size");
AT(AmRecvParam, ucp_am_recv_param_t, recv_attr);
AT(AmRecvParam, ucp_am_recv_param_t, reply_ep);
static_assert(sizeof(u::AmRecvParam) == sizeof(ucp_am_recv_param_t), "AmRecvParam size");
static_assert(offsetof(u::ErrHandler, cb) == offsetof(ucp_err_handler_t, cb), "ErrHandler::cb");
static_assert(offsetof(u::ErrHandler, arg) == offsetof(ucp_err_handler_t, arg), "ErrHandler::arg");
static_assert(sizeof(u::ErrHandler) == sizeof(ucp_err_handler_t), "ErrHandler size");
// The reserve after the declared fields covers what UCX's structs add.
static_assert(sizeof(u::Params) >= sizeof(ucp_params_t), "Params size");
static_assert(sizeof(u::WorkerParams) >= sizeof(ucp_worker_params_t), "WorkerParams size");
static_assert(sizeof(u::WorkerAttr) >= sizeof(ucp_worker_attr_t), "WorkerAttr size");
static_assert(sizeof(u::EpParams) >= sizeof(ucp_ep_params_t), "EpParams size");
static_assert(sizeof(u::EpAttr) >= sizeof(ucp_ep_attr_t), "EpAttr size");
static_assert(sizeof(u::MemMapParams) >= sizeof(ucp_mem_map_params_t), "MemMapParams size");
static_assert(sizeof(u::RequestParam) >= sizeof(ucp_request_param_t), "RequestParam size");

int main() {
  std::printf("ucx_abi_check: ucp_min.h matches UCX %d.%d's headers\n", UCP_API_MAJOR, UCP_API_MINOR);
  return 0;
}
