// Our own minimal declarations of the Ascend ACL runtime (libascendcl.so) and HCCL (libhccl.so,
// libhcomm.so): only the types, values and prototypes pdlink uses, written from the public API
// documentation. No vendor header is copied or included (their licences do not allow it; see
// docs/ascend.md).
//
// Checked against: ACL 1.15 (CANN 8.x, as in Ascend/pytorch third_party/acl at c4840e3c) and
// ACL 1.17 (hicann/runtime include/external/acl at 681ef761) for the ACL part; HCCL's hccl.h and
// hccl_types.h of the same torch_npu revision for the two-sided API; hicann/hcomm
// pkg_inc/legacy/hccl/hccl_one_sided_services.h and hicann/hixl (9ed283b2) for the one-sided API.
// The enum values and struct layouts below are identical across those versions; layouts that are
// not are marked [verify on HW] and used only behind a feature check.
//
// The prototypes exist so that both the loader (backends/ascend/ascend_api.h, which takes
// decltype(&fn) for its function-pointer types and never calls these names directly) and the
// fake libraries in tests/fake_ascend (which define them) are compiled against one declaration:
// a signature that drifts is a compile error, not a crash.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

// ------------------------------------------------------------------------------------------ ACL

typedef int aclError;
typedef void* aclrtStream;
typedef void* aclrtEvent;
typedef void* aclrtContext;

// General codes (acl_base.h; `static const int` there).
constexpr aclError ACL_SUCCESS = 0;
constexpr aclError ACL_ERROR_INVALID_PARAM = 100000;
constexpr aclError ACL_ERROR_UNINITIALIZE = 100001;
constexpr aclError ACL_ERROR_REPEAT_INITIALIZE = 100002;
constexpr aclError ACL_ERROR_REPEAT_FINALIZE = 100037;
constexpr aclError ACL_ERROR_BAD_ALLOC = 200000;
constexpr aclError ACL_ERROR_API_NOT_SUPPORT = 200001;
constexpr aclError ACL_ERROR_INVALID_DEVICE = 200002;
constexpr aclError ACL_ERROR_FEATURE_UNSUPPORTED = 200006;
constexpr aclError ACL_ERROR_INTERNAL_ERROR = 500000;
constexpr aclError ACL_ERROR_FAILURE = 500001;
// Runtime codes (error_codes/rt_error_codes.h; #defines there).
constexpr aclError ACL_ERROR_RT_PARAM_INVALID = 107000;
constexpr aclError ACL_ERROR_RT_INVALID_DEVICEID = 107001;
constexpr aclError ACL_ERROR_RT_CONTEXT_NULL = 107002;
constexpr aclError ACL_ERROR_RT_STREAM_CONTEXT = 107003;
constexpr aclError ACL_ERROR_RT_INVALID_HANDLE = 107017;
constexpr aclError ACL_ERROR_RT_WAIT_TIMEOUT = 107019;
constexpr aclError ACL_ERROR_RT_FEATURE_NOT_SUPPORT = 207000;
constexpr aclError ACL_ERROR_RT_MEMORY_ALLOCATION = 207001;
constexpr aclError ACL_ERROR_RT_MEMORY_FREE = 207002;
constexpr aclError ACL_ERROR_RT_NO_DEVICE = 207004;
constexpr aclError ACL_ERROR_RT_NO_PERMISSION = 207006;
constexpr aclError ACL_ERROR_RT_DEVICE_OOM = 207018;
constexpr aclError ACL_ERROR_RT_INTERNAL_ERROR = 507000;
constexpr aclError ACL_ERROR_RT_STREAM_SYNC_TIMEOUT = 507046;
constexpr aclError ACL_ERROR_RT_EVENT_SYNC_TIMEOUT = 507047;
constexpr aclError ACL_ERROR_RT_DRV_INTERNAL_ERROR = 507899;

typedef enum aclrtMemMallocPolicy {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2,
  ACL_MEM_MALLOC_HUGE_FIRST_P2P = 3,
  ACL_MEM_MALLOC_HUGE_ONLY_P2P = 4,
  ACL_MEM_MALLOC_NORMAL_ONLY_P2P = 5,
} aclrtMemMallocPolicy;

typedef enum aclrtMemcpyKind {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
  ACL_MEMCPY_DEFAULT = 4,
} aclrtMemcpyKind;

typedef enum aclrtEventRecordedStatus {
  ACL_EVENT_RECORDED_STATUS_NOT_READY = 0,
  ACL_EVENT_RECORDED_STATUS_COMPLETE = 1,
} aclrtEventRecordedStatus;

// IPC memory flags (acl_rt.h, ACL >= 1.15).
constexpr uint64_t ACL_RT_IPC_MEM_EXPORT_FLAG_DEFAULT = 0x0;
constexpr uint64_t ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION = 0x1;
constexpr uint64_t ACL_RT_IPC_MEM_IMPORT_FLAG_DEFAULT = 0x0;
constexpr uint64_t ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS = 0x1;
// The key buffer torch_npu and Mooncake use (kAclIpcHandleSize).
constexpr size_t kAclIpcKeyBytes = 65;

typedef struct aclrtIpcEventHandle {
  char reserved[64];
} aclrtIpcEventHandle;

aclError aclInit(const char* configPath);
aclError aclFinalize(void);
aclError aclrtSetDevice(int32_t deviceId);
aclError aclrtResetDevice(int32_t deviceId);
aclError aclrtGetDevice(int32_t* deviceId);
aclError aclrtGetDeviceCount(uint32_t* count);
aclError aclrtGetCurrentContext(aclrtContext* context);
aclError aclrtSetCurrentContext(aclrtContext context);
aclError aclrtCreateStream(aclrtStream* stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);
aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout);  // ms; -1 = forever
aclError aclrtMalloc(void** devPtr, size_t size, aclrtMemMallocPolicy policy);
aclError aclrtFree(void* devPtr);
aclError aclrtMallocHost(void** hostPtr, size_t size);
aclError aclrtFreeHost(void* hostPtr);
aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream);
aclError aclrtCreateEvent(aclrtEvent* event);
aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream);
aclError aclrtSynchronizeEvent(aclrtEvent event);
aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus* status);
aclError aclrtDestroyEvent(aclrtEvent event);
const char* aclGetRecentErrMsg(void);
aclError aclrtGetPhyDevIdByLogicDevId(int32_t logicDevId, int32_t* phyDevId);
aclError aclrtIpcMemGetExportKey(void* devPtr, size_t size, char* key, size_t len, uint64_t flags);
aclError aclrtIpcMemSetImportPid(const char* key, int32_t* pid, size_t num);
aclError aclrtIpcMemImportByKey(void** devPtr, const char* key, uint64_t flags);
aclError aclrtIpcMemClose(const char* key);
aclError aclrtDeviceGetBareTgid(int32_t* pid);

// ----------------------------------------------------------------------------------------- HCCL

typedef void* HcclComm;

typedef enum HcclResult {
  HCCL_SUCCESS = 0,
  HCCL_E_PARA = 1,
  HCCL_E_PTR = 2,
  HCCL_E_MEMORY = 3,
  HCCL_E_INTERNAL = 4,
  HCCL_E_NOT_SUPPORT = 5,
  HCCL_E_NOT_FOUND = 6,
  HCCL_E_UNAVAIL = 7,
  HCCL_E_SYSCALL = 8,
  HCCL_E_TIMEOUT = 9,
  HCCL_E_OPEN_FILE_FAILURE = 10,
  HCCL_E_TCP_CONNECT = 11,
  HCCL_E_ROCE_CONNECT = 12,
  HCCL_E_TCP_TRANSFER = 13,
  HCCL_E_ROCE_TRANSFER = 14,
  HCCL_E_RUNTIME = 15,
  HCCL_E_DRV = 16,
  HCCL_E_PROFILING = 17,
  HCCL_E_CCE = 18,
  HCCL_E_NETWORK = 19,
  HCCL_E_AGAIN = 20,
  HCCL_E_REMOTE = 21,
  HCCL_E_SUSPENDING = 22,
  HCCL_E_OPRETRY_FAIL = 23,
  HCCL_E_OOM = 24,
  HCCL_E_RESERVED
} HcclResult;

typedef enum HcclDataType {
  HCCL_DATA_TYPE_INT8 = 0,
  HCCL_DATA_TYPE_INT16 = 1,
  HCCL_DATA_TYPE_INT32 = 2,
  HCCL_DATA_TYPE_FP16 = 3,
  HCCL_DATA_TYPE_FP32 = 4,
  HCCL_DATA_TYPE_INT64 = 5,
  HCCL_DATA_TYPE_UINT64 = 6,
  HCCL_DATA_TYPE_UINT8 = 7,
  HCCL_DATA_TYPE_RESERVED = 255
} HcclDataType;

constexpr size_t HCCL_ROOT_INFO_BYTES = 4108;
typedef struct HcclRootInfo {
  char internal[HCCL_ROOT_INFO_BYTES];
} HcclRootInfo;

typedef enum HcclSendRecvType { HCCL_SEND = 0, HCCL_RECV = 1, HCCL_SEND_RECV_RESERVED } HcclSendRecvType;

typedef struct HcclSendRecvItem {
  HcclSendRecvType sendRecvType;
  void* buf;
  uint64_t count;
  HcclDataType dataType;
  uint32_t remoteRank;
} HcclSendRecvItem;

HcclResult HcclGetRootInfo(HcclRootInfo* rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank, HcclComm* comm);
HcclResult HcclCommDestroy(HcclComm comm);
HcclResult HcclSend(void* sendBuf, uint64_t count, HcclDataType dataType, uint32_t destRank, HcclComm comm,
                    aclrtStream stream);
HcclResult HcclRecv(void* recvBuf, uint64_t count, HcclDataType dataType, uint32_t srcRank, HcclComm comm,
                    aclrtStream stream);
HcclResult HcclBatchSendRecv(HcclSendRecvItem* sendRecvInfo, uint32_t itemNum, HcclComm comm, aclrtStream stream);
const char* HcclGetErrorString(HcclResult code);
HcclResult HcclGetCommAsyncError(HcclComm comm, HcclResult* asyncError);

// One-sided API (hcomm's pkg_inc, not public hccl.h; libhcomm.so on CANN after January 2026,
// libhccl.so before). Layouts [verify on HW]: they changed between releases.
typedef enum CommMemType { COMM_MEM_TYPE_DEVICE = 0, COMM_MEM_TYPE_HOST = 1 } CommMemType;
typedef struct CommMem {
  CommMemType type;
  void* addr;
  uint64_t size;
} CommMem;
typedef struct HcclOneSideOpDesc {
  void* localAddr;
  void* remoteAddr;
  uint64_t count;
  HcclDataType dataType;
} HcclOneSideOpDesc;
typedef struct HcclPrepareConfig {
  int32_t topoType;  // HCCL_TOPO_FULLMESH = 0
  uint64_t rsvd[3];
} HcclPrepareConfig;

HcclResult HcclRegisterGlobalMem(const CommMem* mem, void** memHandle);
HcclResult HcclDeregisterGlobalMem(void* memHandle);
HcclResult HcclCommBindMem(HcclComm comm, void* memHandle);
HcclResult HcclCommUnbindMem(HcclComm comm, void* memHandle);
HcclResult HcclCommPrepare(HcclComm comm, const HcclPrepareConfig* config, int32_t timeoutSec);
HcclResult HcclBatchPut(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc* desc, uint32_t descNum,
                        aclrtStream stream);
HcclResult HcclBatchGet(HcclComm comm, uint32_t remoteRank, HcclOneSideOpDesc* desc, uint32_t descNum,
                        aclrtStream stream);

}  // extern "C"

// ABI guards (LP64): the sizes the vendor libraries read and write.
static_assert(sizeof(aclError) == 4, "aclError is an int");
static_assert(sizeof(aclrtMemcpyKind) == 4 && sizeof(aclrtMemMallocPolicy) == 4, "ACL enums are int-sized");
static_assert(sizeof(aclrtIpcEventHandle) == 64, "aclrtIpcEventHandle is 64 bytes");
static_assert(sizeof(HcclResult) == 4 && sizeof(HcclDataType) == 4, "HCCL enums are int-sized");
static_assert(sizeof(HcclRootInfo) == 4108, "HcclRootInfo is 4108 bytes");
static_assert(sizeof(HcclSendRecvItem) == 32, "HcclSendRecvItem is 32 bytes");
static_assert(offsetof(HcclSendRecvItem, buf) == 8 && offsetof(HcclSendRecvItem, count) == 16 &&
                  offsetof(HcclSendRecvItem, dataType) == 24 && offsetof(HcclSendRecvItem, remoteRank) == 28,
              "HcclSendRecvItem layout");
static_assert(sizeof(CommMem) == 24 && offsetof(CommMem, addr) == 8, "CommMem is 24 bytes");
static_assert(sizeof(HcclOneSideOpDesc) == 32 && offsetof(HcclOneSideOpDesc, dataType) == 24,
              "HcclOneSideOpDesc is 32 bytes");
static_assert(sizeof(HcclPrepareConfig) == 32, "HcclPrepareConfig is 32 bytes");
