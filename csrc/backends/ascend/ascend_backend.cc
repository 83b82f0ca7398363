// The Ascend backend: DEVICE memory from aclrtMalloc, copies through aclrtMemcpy, device channels
// as two-rank HCCL communicators moving bytes with HcclBatchSendRecv (or, once prepared, one-sided
// HcclBatchGet/Put) on a stream of their own, and same-host sharing through aclrtIpcMem* keys.
//
// ACL keeps the current device context per thread, and pdlink's calls arrive on many threads (the
// caller's, with the GIL released, and the engine's serving threads), some of which also belong to
// the application (torch_npu binds its own device on them). So every call binds this backend's
// context for its duration and restores whatever the thread had before (ContextGuard).
#include "backends/ascend/ascend_backend.h"

#include <algorithm>
#include <mutex>

#include "core/log.h"

namespace pdlink::ascend {
namespace {

// Binds `ctx` on the calling thread for one scope, restoring the previous context afterwards.
class ContextGuard {
 public:
  ContextGuard(const AscendApi* api, aclrtContext ctx) : api_(api) {
    if (api_->aclrtGetCurrentContext(&prev_) != ACL_SUCCESS) prev_ = nullptr;
    if (prev_ != ctx) {
      rc_ = api_->aclrtSetCurrentContext(ctx);
      switched_ = rc_ == ACL_SUCCESS;
    }
  }
  ~ContextGuard() {
    if (switched_ && prev_) api_->aclrtSetCurrentContext(prev_);
  }
  Status status() const { return rc_ == ACL_SUCCESS ? Status::OK() : api_->aclError("aclrtSetCurrentContext", rc_); }

 private:
  const AscendApi* api_;
  aclrtContext prev_ = nullptr;
  bool switched_ = false;
  int rc_ = ACL_SUCCESS;
};

aclrtMemcpyKind copyKind(Placement dst, Placement src) {
  if (dst == Placement::kDevice)
    return src == Placement::kDevice ? ACL_MEMCPY_DEVICE_TO_DEVICE : ACL_MEMCPY_HOST_TO_DEVICE;
  return src == Placement::kDevice ? ACL_MEMCPY_DEVICE_TO_HOST : ACL_MEMCPY_HOST_TO_HOST;
}

// Waits for everything queued on `stream`, bounded by `deadline` when the runtime can bound it.
Status synchronizeStream(const AscendApi* api, aclrtStream stream, Deadline deadline) {
  int rc;
  const char* call;
  if (api->aclrtSynchronizeStreamWithTimeout) {
    int ms = deadline.remainingMsForPoll();  // -1: forever, as ACL's convention
    call = "aclrtSynchronizeStreamWithTimeout";
    rc = api->aclrtSynchronizeStreamWithTimeout(stream, ms == 0 ? 1 : ms);
  } else {
    call = "aclrtSynchronizeStream";
    rc = api->aclrtSynchronizeStream(stream);
  }
  return rc == ACL_SUCCESS ? Status::OK() : api->aclError(call, rc);
}

// HcclBatchSendRecv items per call: bounds the item array; both sides cut at the same places
// because their segment lists have the same lengths.
constexpr size_t kItemsPerBatch = 4096;

class HcclChannel final : public DeviceChannel {
 public:
  HcclChannel(const AscendApi* api, aclrtContext ctx, HcclComm comm, aclrtStream stream, uint32_t peer_rank)
      : api_(api), ctx_(ctx), comm_(comm), stream_(stream), peer_rank_(peer_rank) {}
  ~HcclChannel() override {
    ContextGuard g(api_, ctx_);
    releaseMemory();
    // Destroying the communicator first ends any transfer still queued on the stream (a timed-out
    // one), so destroying the stream cannot wait on it.
    if (int rc = api_->HcclCommDestroy(comm_); rc != HCCL_SUCCESS) {
      PDLINK_LOG(kWarn, api_->hcclError("HcclCommDestroy", rc).message());
    }
    if (int rc = api_->aclrtDestroyStream(stream_); rc != ACL_SUCCESS) {
      PDLINK_LOG(kWarn, api_->aclError("aclrtDestroyStream", rc).message());
    }
  }
  Status send(const std::vector<Segment>& segments, Deadline deadline) override {
    return run(segments, HCCL_SEND, deadline);
  }
  Status recv(const std::vector<Segment>& segments, Deadline deadline) override {
    return run(segments, HCCL_RECV, deadline);
  }

  bool canPrepare() const override { return api_->features.at("one_sided"); }

  // HcclRegisterGlobalMem + HcclCommBindMem per region, then HcclCommPrepare (both ranks).
  Status prepare(const std::vector<Segment>& regions, int32_t timeout_s) override {
    if (!canPrepare()) return DeviceChannel::prepare(regions, timeout_s);
    ContextGuard g(api_, ctx_);
    PDLINK_RETURN_IF_ERROR(g.status());
    Status st;
    for (const Segment& r : regions) {
      CommMem mem{COMM_MEM_TYPE_DEVICE, reinterpret_cast<void*>(r.addr), r.length};
      void* handle = nullptr;
      int rc = api_->HcclRegisterGlobalMem(&mem, &handle);
      if (rc != HCCL_SUCCESS) {
        st = api_->hcclError("HcclRegisterGlobalMem", rc);
        break;
      }
      registered_.push_back(handle);
      if ((rc = api_->HcclCommBindMem(comm_, handle)) != HCCL_SUCCESS) {
        st = api_->hcclError("HcclCommBindMem", rc);
        break;
      }
      bound_.push_back(handle);
    }
    if (st.ok()) {
      HcclPrepareConfig config{};  // topoType 0: full mesh
      int rc = api_->HcclCommPrepare(comm_, &config, timeout_s);
      if (rc != HCCL_SUCCESS) st = api_->hcclError("HcclCommPrepare", rc);
    }
    if (!st.ok()) {
      releaseMemory();
      return st;
    }
    regions_ = regions;
    return Status::OK();
  }

  bool prepared(uint64_t addr, uint64_t length) const override {
    for (const Segment& r : regions_) {
      if (addr >= r.addr && length <= r.length && addr - r.addr <= r.length - length) return true;
    }
    return false;
  }

  Status get(const std::vector<DeviceCopy>& copies, Deadline deadline) override {
    return oneSided(copies, false, deadline);
  }
  Status put(const std::vector<DeviceCopy>& copies, Deadline deadline) override {
    return oneSided(copies, true, deadline);
  }

 private:
  // LLM-DataDist issues at most 64 descriptors per HcclBatchGet/Put call (kMaxBatchPutNum).
  static constexpr size_t kDescsPerCall = 64;

  Status oneSided(const std::vector<DeviceCopy>& copies, bool put, Deadline deadline) {
    if (regions_.empty()) return Status(Code::kFeatureNotEnabled, "the channel was not prepared for one-sided access");
    ContextGuard g(api_, ctx_);
    PDLINK_RETURN_IF_ERROR(g.status());
    std::vector<HcclOneSideOpDesc> descs;
    for (size_t i = 0; i < copies.size(); i += kDescsPerCall) {
      descs.clear();
      for (size_t j = i; j < std::min(copies.size(), i + kDescsPerCall); ++j) {
        const DeviceCopy& c = copies[j];
        // get: local = dst, remote = src; put: local = src, remote = dst.
        void* local = reinterpret_cast<void*>(put ? c.src : c.dst);
        void* remote = reinterpret_cast<void*>(put ? c.dst : c.src);
        descs.push_back(HcclOneSideOpDesc{local, remote, c.length, HCCL_DATA_TYPE_UINT8});
      }
      int rc = put ? api_->HcclBatchPut(comm_, peer_rank_, descs.data(), static_cast<uint32_t>(descs.size()), stream_)
                   : api_->HcclBatchGet(comm_, peer_rank_, descs.data(), static_cast<uint32_t>(descs.size()), stream_);
      if (rc != HCCL_SUCCESS) {
        // What was queued before must land (or fail) before the caller's memory may be reused.
        (void)synchronize(Deadline::never());
        return api_->hcclError(put ? "HcclBatchPut" : "HcclBatchGet", rc);
      }
    }
    return synchronize(deadline);
  }

  void releaseMemory() {
    for (void* h : bound_) (void)api_->HcclCommUnbindMem(comm_, h);
    for (void* h : registered_) (void)api_->HcclDeregisterGlobalMem(h);
    bound_.clear();
    registered_.clear();
    regions_.clear();
  }

  Status run(const std::vector<Segment>& segments, HcclSendRecvType type, Deadline deadline) {
    ContextGuard g(api_, ctx_);
    PDLINK_RETURN_IF_ERROR(g.status());
    std::vector<HcclSendRecvItem> items;
    items.reserve(std::min(segments.size(), kItemsPerBatch));
    for (size_t i = 0; i < segments.size(); i += kItemsPerBatch) {
      items.clear();
      for (size_t j = i; j < std::min(segments.size(), i + kItemsPerBatch); ++j) {
        items.push_back(HcclSendRecvItem{type, reinterpret_cast<void*>(segments[j].addr), segments[j].length,
                                         HCCL_DATA_TYPE_UINT8, peer_rank_});
      }
      int rc = api_->HcclBatchSendRecv(items.data(), static_cast<uint32_t>(items.size()), comm_, stream_);
      if (rc != HCCL_SUCCESS) return api_->hcclError("HcclBatchSendRecv", rc);
    }
    return synchronize(deadline);
  }

  Status synchronize(Deadline deadline) {
    Status st = synchronizeStream(api_, stream_, deadline);
    if (st.ok()) return st;
    // The communicator knows why a transfer failed (remote error, peer gone, count mismatch).
    HcclResult async = HCCL_SUCCESS;
    if (st.code() != Code::kTimeout && api_->HcclGetCommAsyncError &&
        api_->HcclGetCommAsyncError(comm_, &async) == HCCL_SUCCESS && async != HCCL_SUCCESS) {
      Status why = api_->hcclError("HcclBatchSendRecv", async);
      return Status(why.code(), why.message() + " (" + st.message() + ")");
    }
    return st;
  }

  const AscendApi* api_;
  aclrtContext ctx_;
  HcclComm comm_;
  aclrtStream stream_;
  uint32_t peer_rank_;
  std::vector<void*> registered_;  // HcclRegisterGlobalMem handles (one-sided)
  std::vector<void*> bound_;       // ... of those, bound to comm_
  std::vector<Segment> regions_;   // this side's memory the peer may reach, once prepared
};

}  // namespace

Result<std::shared_ptr<AscendBackend>> AscendBackend::create(const AscendApi* api, int32_t device_id) {
  int rc = api->aclInit(nullptr);
  // An application (torch_npu) may have initialised ACL already: use it as is. pdlink never calls
  // aclFinalize or aclrtResetDevice (it cannot know who else still uses the runtime).
  if (rc != ACL_SUCCESS && rc != ACL_ERROR_REPEAT_INITIALIZE) return api->aclError("aclInit", rc);
  uint32_t count = 0;
  if ((rc = api->aclrtGetDeviceCount(&count)) != ACL_SUCCESS) return api->aclError("aclrtGetDeviceCount", rc);
  if (count == 0) return Status(Code::kFeatureNotEnabled, "Ascend backend unavailable: the runtime reports no device");
  if (device_id < 0 || static_cast<uint32_t>(device_id) >= count) {
    return Status(Code::kParamInvalid, "device_id " + std::to_string(device_id) +
                                           " out of range: the runtime reports " + std::to_string(count) +
                                           " device(s)");
  }
  // aclrtSetDevice binds the calling thread; put back what the thread had (the application's).
  aclrtContext prev = nullptr;
  if (api->aclrtGetCurrentContext(&prev) != ACL_SUCCESS) prev = nullptr;
  if ((rc = api->aclrtSetDevice(device_id)) != ACL_SUCCESS) return api->aclError("aclrtSetDevice", rc);
  aclrtContext ctx = nullptr;
  rc = api->aclrtGetCurrentContext(&ctx);
  if (prev) api->aclrtSetCurrentContext(prev);
  if (rc != ACL_SUCCESS) return api->aclError("aclrtGetCurrentContext", rc);
  int32_t phy = device_id;
  if (api->aclrtGetPhyDevIdByLogicDevId) (void)api->aclrtGetPhyDevIdByLogicDevId(device_id, &phy);
  PDLINK_LOG(kInfo, "Ascend backend on device " << device_id << " (physical " << phy << ") from "
                                                << (api->library_dir.empty() ? "the loader path" : api->library_dir));
  return std::shared_ptr<AscendBackend>(new AscendBackend(api, device_id, ctx));
}

Capabilities AscendBackend::capabilities() const {
  Capabilities c;
  c.device_memory = true;
  c.host_memory = true;
  c.device_transport = true;
  c.features = api_->features;
  return c;
}

Result<void*> AscendBackend::allocate(Placement placement, size_t bytes) {
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  void* p = nullptr;
  int rc;
  if (placement == Placement::kDevice) {
    rc = api_->aclrtMalloc(&p, bytes, ACL_MEM_MALLOC_HUGE_FIRST);
    if (rc != ACL_SUCCESS) return api_->aclError("aclrtMalloc", rc);
  } else {
    rc = api_->aclrtMallocHost(&p, bytes);  // pinned: the fastest source/target of device copies
    if (rc != ACL_SUCCESS) {
      Status st = api_->aclError("aclrtMallocHost", rc);
      return Status(st.code() == Code::kDeviceOutOfMemory ? Code::kOutOfMemory : st.code(), st.message());
    }
  }
  return p;
}

void AscendBackend::release(Placement placement, void* ptr, size_t) {
  ContextGuard g(api_, ctx_);
  int rc = placement == Placement::kDevice ? api_->aclrtFree(ptr) : api_->aclrtFreeHost(ptr);
  if (rc != ACL_SUCCESS) PDLINK_LOG(kWarn, api_->aclError("aclrtFree", rc).message());
}

Status AscendBackend::copy(void* dst, Placement dst_placement, const void* src, Placement src_placement, size_t n) {
  if (n == 0) return Status::OK();
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  int rc = api_->aclrtMemcpy(dst, n, src, n, copyKind(dst_placement, src_placement));
  return rc == ACL_SUCCESS ? Status::OK() : api_->aclError("aclrtMemcpy", rc);
}

Result<std::string> AscendBackend::newRendezvous() {
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  HcclRootInfo root{};
  int rc = api_->HcclGetRootInfo(&root);
  if (rc != HCCL_SUCCESS) return api_->hcclError("HcclGetRootInfo", rc);
  return std::string(root.internal, sizeof(root.internal));
}

Result<std::unique_ptr<DeviceChannel>> AscendBackend::joinChannel(const std::string& rendezvous, bool creator) {
  if (rendezvous.size() != sizeof(HcclRootInfo)) {
    return Status(Code::kParamInvalid, "HCCL root info must be " + std::to_string(sizeof(HcclRootInfo)) +
                                           " bytes, got " + std::to_string(rendezvous.size()));
  }
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  HcclRootInfo root;
  std::copy(rendezvous.begin(), rendezvous.end(), root.internal);
  const uint32_t rank = creator ? 0 : 1;
  HcclComm comm = nullptr;
  int rc = api_->HcclCommInitRootInfo(2, &root, rank, &comm);
  if (rc != HCCL_SUCCESS) return api_->hcclError("HcclCommInitRootInfo", rc);
  aclrtStream stream = nullptr;
  if ((rc = api_->aclrtCreateStream(&stream)) != ACL_SUCCESS) {
    api_->HcclCommDestroy(comm);
    return api_->aclError("aclrtCreateStream", rc);
  }
  return std::unique_ptr<DeviceChannel>(new HcclChannel(api_, ctx_, comm, stream, 1 - rank));
}

// ---------------------------------------------------------------- IPC

Result<std::string> AscendBackend::exportMemory(uint64_t addr, uint64_t length) {
  if (!api_->aclrtIpcMemGetExportKey) {
    return Status(Code::kFeatureNotEnabled, "this Ascend runtime has no IPC memory sharing (aclrtIpcMem*)");
  }
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  char key[kAclIpcKeyBytes] = {};
  int rc = api_->aclrtIpcMemGetExportKey(reinterpret_cast<void*>(addr), length, key, sizeof(key),
                                         ACL_RT_IPC_MEM_EXPORT_FLAG_DISABLE_PID_VALIDATION);
  if (rc != ACL_SUCCESS) return api_->aclError("aclrtIpcMemGetExportKey", rc);
  key[sizeof(key) - 1] = '\0';
  return std::string(key);
}

void AscendBackend::closeExport(const std::string& key) { closeImport(key); }  // one call closes either side

Result<uint64_t> AscendBackend::importMemory(const std::string& key) {
  if (!api_->aclrtIpcMemImportByKey) {
    return Status(Code::kFeatureNotEnabled, "this Ascend runtime has no IPC memory sharing (aclrtIpcMem*)");
  }
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  void* p = nullptr;
  int rc = api_->aclrtIpcMemImportByKey(&p, key.c_str(), ACL_RT_IPC_MEM_IMPORT_FLAG_ENABLE_PEER_ACCESS);
  if (rc != ACL_SUCCESS) return api_->aclError("aclrtIpcMemImportByKey", rc);
  return reinterpret_cast<uint64_t>(p);
}

void AscendBackend::closeImport(const std::string& key) {
  if (!api_->aclrtIpcMemClose) return;
  ContextGuard g(api_, ctx_);
  if (int rc = api_->aclrtIpcMemClose(key.c_str()); rc != ACL_SUCCESS) {
    PDLINK_LOG(kWarn, api_->aclError("aclrtIpcMemClose", rc).message());
  }
}

Status AscendBackend::copyDevice(const std::vector<DeviceCopy>& copies, Deadline deadline) {
  ContextGuard g(api_, ctx_);
  PDLINK_RETURN_IF_ERROR(g.status());
  aclrtStream stream = nullptr;
  {
    std::lock_guard<std::mutex> lock(streams_mu_);
    if (!idle_streams_.empty()) {
      stream = idle_streams_.back();
      idle_streams_.pop_back();
    }
  }
  if (!stream) {
    if (int rc = api_->aclrtCreateStream(&stream); rc != ACL_SUCCESS) return api_->aclError("aclrtCreateStream", rc);
  }
  Status st;
  for (const DeviceCopy& c : copies) {
    int rc = api_->aclrtMemcpyAsync(reinterpret_cast<void*>(c.dst), c.length, reinterpret_cast<const void*>(c.src),
                                    c.length, ACL_MEMCPY_DEVICE_TO_DEVICE, stream);
    if (rc != ACL_SUCCESS) {
      st = api_->aclError("aclrtMemcpyAsync", rc);
      break;
    }
  }
  // Whatever was queued must finish before the memory may be unmapped, even after a failed enqueue.
  Status synced = synchronizeStream(api_, stream, st.ok() ? deadline : Deadline::never());
  if (synced.ok()) {
    std::lock_guard<std::mutex> lock(streams_mu_);
    idle_streams_.push_back(stream);
  } else {
    api_->aclrtDestroyStream(stream);  // waits for what is still queued; never reused
  }
  return st.ok() ? synced : st;
}

}  // namespace pdlink::ascend
