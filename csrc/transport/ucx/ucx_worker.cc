// UCP contexts, workers, endpoints and mapped memory (transport/ucx/ucx_worker.h).
#include "transport/ucx/ucx_worker.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <set>

namespace pdlink::ucx {
namespace {

// UCX_TLS names that move bytes through this host's memory rather than a network device.
const std::set<std::string>& localTransports() {
  static const std::set<std::string> names = {"sm", "shm", "mm", "posix", "sysv", "cma", "knem", "xpmem", "self"};
  return names;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= s.size()) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    if (comma > at) out.push_back(s.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

std::string joinComma(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

}  // namespace

Result<std::string> transportsFor(Scope scope, const char* user) {
  std::string tls = user ? user : "";
  if (scope == Scope::kAny) return tls;
  if (tls.empty() || tls == "all") return std::string("^sm,self");
  if (tls[0] == '^') {
    std::vector<std::string> names = split(tls.substr(1));
    for (const char* local : {"sm", "self"}) {
      if (std::find(names.begin(), names.end(), local) == names.end()) names.push_back(local);
    }
    return "^" + joinComma(names);
  }
  std::vector<std::string> kept;
  for (const std::string& name : split(tls)) {
    if (!localTransports().count(name)) kept.push_back(name);
  }
  if (kept.empty()) {
    return Status(Code::kFeatureNotEnabled,
                  "UCX_TLS=" + tls + " names no network transport, and a peer not proven to be on this host "
                  "may not use shared memory; add one (tcp, rc, dc, ud, ib) or link same-host peers only");
  }
  return joinComma(kept);
}

// ------------------------------------------------------------------------------ UcxWorker

Result<std::unique_ptr<UcxWorker>> UcxWorker::open(Scope scope) {
  Result<const UcpApi*> loaded = load();
  if (!loaded.ok()) return loaded.status();
  const UcpApi* api = loaded.value();
  Result<std::string> tls = transportsFor(scope, std::getenv("UCX_TLS"));
  if (!tls.ok()) return tls.status();
  std::unique_ptr<UcxWorker> w(new UcxWorker(api, scope));
  w->transports_ = tls.value();

  ucp_config_t* config = nullptr;
  ucs_status_t st = api->ucp_config_read(nullptr, nullptr, &config);  // UCX_* from the environment
  if (st != kOk) return toStatus(st, "ucx: reading UCX's configuration");
  if (!w->transports_.empty()) st = api->ucp_config_modify(config, "TLS", w->transports_.c_str());
  if (st == kOk) {
    Params params;
    params.field_mask = kParamFieldFeatures;
    params.features = kFeatureRma | kFeatureWakeup;
    st = api->ucp_init_version(kApiMajor, kApiMinor, &params, config, &w->context_);
  }
  api->ucp_config_release(config);
  if (st != kOk) return toStatus(st, "ucx: creating a context with UCX_TLS=" + w->transports_);

  WorkerParams wp;
  wp.field_mask = kWorkerParamFieldThreadMode;
  wp.thread_mode = kThreadModeMulti;
  st = api->ucp_worker_create(w->context_, &wp, &w->worker_);
  if (st != kOk) return toStatus(st, "ucx: creating a worker");

  WorkerAttr attr;
  attr.field_mask = kWorkerAttrFieldAddress | kWorkerAttrFieldAddressFlags;
  attr.address_flags = scope == Scope::kNetwork ? kWorkerAddressFlagNetOnly : 0;
  st = api->ucp_worker_query(w->worker_, &attr);
  if (st != kOk) return toStatus(st, "ucx: reading the worker's address");
  w->address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  api->ucp_worker_release_address(w->worker_, attr.address);

  st = api->ucp_worker_get_efd(w->worker_, &w->efd_);
  if (st != kOk) return toStatus(st, "ucx: reading the worker's event fd");
  return w;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) api_->ucp_worker_destroy(worker_);
  if (context_ != nullptr) api_->ucp_cleanup(context_);
}

Result<std::unique_ptr<UcxEndpoint>> UcxWorker::connect(const std::string& peer_address) {
  if (peer_address.empty()) return Status(Code::kLinkFailed, "ucx: the peer sent an empty worker address");
  std::unique_ptr<UcxEndpoint> ep(new UcxEndpoint(this, nullptr));
  EpParams params;
  params.field_mask = kEpParamFieldRemoteAddress | kEpParamFieldErrHandlingMode | kEpParamFieldErrHandler;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  params.err_mode = kErrHandlingModePeer;
  params.err_handler.cb = &UcxEndpoint::onError;
  params.err_handler.arg = ep.get();
  ucs_status_t st = api_->ucp_ep_create(worker_, &params, &ep->ep_);
  if (st != kOk) {
    // UCX refuses an endpoint whose lanes cannot report a peer's death (its shared-memory
    // transports alone cannot; tcp beside them can).
    return toStatus(st, "ucx: connecting to the peer's worker (UCX_TLS=" + transports_ +
                            "; UCX needs a transport that reports peer failures, tcp say, beside shared memory)");
  }
  return ep;
}

Result<std::unique_ptr<UcxMemory>> UcxWorker::map(uint64_t address, uint64_t length, bool remote_writable) {
  if (address == 0 || length == 0) return Status(Code::kParamInvalid, "ucx: mapping an empty range");
  MemMapParams params;
  params.field_mask = kMemMapParamFieldAddress | kMemMapParamFieldLength | kMemMapParamFieldProt;
  params.address = reinterpret_cast<void*>(address);
  params.length = length;
  params.prot = kProtLocalRead | kProtLocalWrite | kProtRemoteRead | (remote_writable ? kProtRemoteWrite : 0);
  ucp_mem_h memh = nullptr;
  ucs_status_t st = api_->ucp_mem_map(context_, &params, &memh);
  if (st != kOk) return toStatus(st, "ucx: mapping " + std::to_string(length) + " bytes");
  void* buffer = nullptr;
  size_t size = 0;
  st = api_->ucp_rkey_pack(context_, memh, &buffer, &size);
  if (st != kOk) {
    api_->ucp_mem_unmap(context_, memh);
    return toStatus(st, "ucx: packing a remote key");
  }
  std::string packed(static_cast<const char*>(buffer), size);
  api_->ucp_rkey_buffer_release(buffer);
  return std::unique_ptr<UcxMemory>(
      new UcxMemory(api_, context_, memh, address, length, remote_writable, std::move(packed)));
}

void UcxWorker::progress() {
  while (api_->ucp_worker_progress(worker_) != 0) {
  }
}

bool UcxWorker::arm() { return api_->ucp_worker_arm(worker_) == kOk; }

void UcxWorker::signal() { api_->ucp_worker_signal(worker_); }

ucs_status_t UcxWorker::wait(ucs_status_ptr_t request, Deadline deadline) {
  if (!ptrIsPtr(request)) return ptrStatus(request);  // completed at once, or failed at once
  ucs_status_t st = kInProgress;
  // Requests of one call complete in order of their lanes within microseconds to milliseconds;
  // spinning on progress keeps a small read's latency at UCX's own. The deadline bounds the spin.
  for (uint32_t spins = 0;; ++spins) {
    api_->ucp_worker_progress(worker_);
    st = api_->ucp_request_check_status(request);
    if (st != kInProgress) break;
    if ((spins & 63) == 0 && deadline.expired()) break;
  }
  if (st == kInProgress) return kErrTimedOut;  // the caller force-closes the endpoint, which ends the request
  api_->ucp_request_free(request);
  return st;
}

// ------------------------------------------------------------------------------ UcxEndpoint

void UcxEndpoint::onError(void* arg, ucp_ep_h, ucs_status_t status) {
  __atomic_store_n(&static_cast<UcxEndpoint*>(arg)->error_, status == kOk ? kErrConnectionReset : status,
                   __ATOMIC_RELEASE);
}

bool UcxEndpoint::failed() const { return __atomic_load_n(&error_, __ATOMIC_ACQUIRE) != 0; }

Result<std::unique_ptr<UcxRemoteKey>> UcxEndpoint::unpack(const std::string& packed) {
  if (ep_ == nullptr) return Status(Code::kLinkFailed, "ucx: the endpoint was closed");
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = worker_->api_->ucp_ep_rkey_unpack(ep_, packed.data(), &rkey);
  if (st != kOk) return Status(Code::kLinkFailed, "ucx: the peer's remote key: " + statusText(st));
  return std::unique_ptr<UcxRemoteKey>(new UcxRemoteKey(worker_->api_, rkey));
}

Status UcxEndpoint::rma(const UcxRemoteKey& key, const std::vector<RmaRun>& runs, bool write, Deadline deadline) {
  const UcpApi* api = worker_->api_;
  const char* what = write ? "ucx write" : "ucx read";
  if (ep_ == nullptr) return Status(Code::kLinkFailed, std::string(what) + ": the endpoint was closed");
  if (failed()) return toStatus(__atomic_load_n(&error_, __ATOMIC_ACQUIRE), what);
  // Post every run, then wait for them in order; a write is then flushed (its runs complete
  // locally first: only the flush says they reached the peer's memory).
  thread_local std::vector<ucs_status_ptr_t> pending;
  pending.clear();
  RequestParam param;
  ucs_status_t st = kOk;
  for (const RmaRun& r : runs) {
    ucs_status_ptr_t req =
        write ? api->ucp_put_nbx(ep_, reinterpret_cast<const void*>(r.local), r.length, r.remote, key.handle(), &param)
              : api->ucp_get_nbx(ep_, reinterpret_cast<void*>(r.local), r.length, r.remote, key.handle(), &param);
    if (ptrIsErr(req)) {
      st = ptrStatus(req);
      break;
    }
    if (req != nullptr) pending.push_back(req);
  }
  if (st == kOk && write) {
    ucs_status_ptr_t flush = api->ucp_ep_flush_nbx(ep_, &param);
    if (ptrIsErr(flush)) {
      st = ptrStatus(flush);
    } else if (flush != nullptr) {
      pending.push_back(flush);
    }
  }
  size_t done = 0;
  for (; done < pending.size(); ++done) {
    ucs_status_t r = worker_->wait(pending[done], deadline);
    if (r == kErrTimedOut) break;
    if (r != kOk && st == kOk) st = r;
  }
  if (done < pending.size()) {
    // The deadline passed: closing the endpoint by force completes what is still pending (with
    // an error), after which each request can be freed.
    closeForce();
    for (; done < pending.size(); ++done) {
      while (api->ucp_request_check_status(pending[done]) == kInProgress) api->ucp_worker_progress(worker_->worker_);
      api->ucp_request_free(pending[done]);
    }
    return Status(Code::kTimeout, std::string(what) + ": not complete by the deadline; the endpoint was closed");
  }
  if (st != kOk) return toStatus(failed() ? __atomic_load_n(&error_, __ATOMIC_ACQUIRE) : st, what);
  return Status::OK();
}

void UcxEndpoint::closeForce() {
  if (ep_ == nullptr) return;
  const UcpApi* api = worker_->api_;
  RequestParam param;
  param.op_attr_mask = kOpAttrFieldFlags;
  param.flags = kEpCloseFlagForce;
  ucs_status_ptr_t req = api->ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  if (ptrIsPtr(req)) {
    // A forced close completes locally, without the peer.
    while (api->ucp_request_check_status(req) == kInProgress) api->ucp_worker_progress(worker_->worker_);
    api->ucp_request_free(req);
  }
}

UcxEndpoint::~UcxEndpoint() { closeForce(); }

UcxRemoteKey::~UcxRemoteKey() { api_->ucp_rkey_destroy(rkey_); }

UcxMemory::~UcxMemory() { api_->ucp_mem_unmap(context_, memh_); }

}  // namespace pdlink::ucx
