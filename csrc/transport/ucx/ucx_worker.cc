// UCP contexts, workers, endpoints and mapped memory (transport/ucx/ucx_worker.h).
#include "transport/ucx/ucx_worker.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

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
  if (scope == Scope::kAny) return tls;  // "" (unset or empty): UCX's default, all
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

std::string transportFamily(const std::string& lane) {
  return lane.substr(0, std::min(lane.find('_'), lane.find('/')));
}

std::vector<std::string> autoFamilies(const char* setting) {
  if (setting == nullptr) return {"rc", "dc", "ud", "srd"};
  std::vector<std::string> out;
  for (const std::string& name : split(setting)) out.push_back(transportFamily(name));
  return out;
}

bool anyLaneOf(const std::vector<std::string>& lanes, const std::vector<std::string>& families) {
  return std::any_of(lanes.begin(), lanes.end(), [&](const std::string& lane) {
    return std::find(families.begin(), families.end(), transportFamily(lane)) != families.end();
  });
}

bool autoPicksUcx(const std::vector<std::string>& network_lanes) {
  return anyLaneOf(network_lanes, autoFamilies(std::getenv("PDLINK_UCX_AUTO_TRANSPORTS")));
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
  // An empty UCX_TLS (set, but to nothing) would fail UCX's own parsing: it means UCX's default.
  st = api->ucp_config_modify(config, "TLS", w->transports_.empty() ? "all" : w->transports_.c_str());
  if (st == kOk) {
    Params params;
    params.field_mask = kParamFieldFeatures;
    params.features = kFeatureAm | kFeatureWakeup;  // never kFeatureRma: see the header
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
  std::unique_ptr<UcxEndpoint> ep(new UcxEndpoint(this));
  EpParams params;
  params.field_mask = kEpParamFieldRemoteAddress | kEpParamFieldErrHandlingMode | kEpParamFieldErrHandler;
  params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  if (scope_ == Scope::kAny) {
    // A peer the kernel proved to be on this host: UCX's shared-memory transports cannot report
    // its death (an endpoint that asks for that gets none of them), so this one does not ask.
    // pdlink notices a dead same-host peer itself: its control link closes, and every wait on
    // this endpoint is bounded by the transfer's deadline.
    params.field_mask = kEpParamFieldRemoteAddress;
  } else {
    params.err_mode = kErrHandlingModePeer;
    params.err_handler.cb = &UcxEndpoint::onError;
    params.err_handler.arg = ep.get();
  }
  ucs_status_t st = api_->ucp_ep_create(worker_, &params, &ep->ep_);
  if (st != kOk) return toStatus(st, "ucx: connecting to the peer's worker (UCX_TLS=" + transports_ + ")");
  if (api_->ucp_ep_query != nullptr) {
    // UCX fills at most num_entries entries (one per lane; lanes may share a transport).
    TransportEntry entries[32] = {};
    EpAttr attr;
    attr.field_mask = kEpAttrFieldTransports;
    attr.transports.entries = entries;
    attr.transports.num_entries = 32;
    attr.transports.entry_size = sizeof(TransportEntry);
    if (api_->ucp_ep_query(ep->ep_, &attr) == kOk) {
      for (unsigned i = 0; i < std::min(attr.transports.num_entries, 32u); ++i) {
        if (entries[i].transport_name == nullptr) continue;
        std::string lane = std::string(entries[i].transport_name) + "/" +
                           (entries[i].device_name ? entries[i].device_name : "");
        if (std::find(ep->lanes_.begin(), ep->lanes_.end(), lane) == ep->lanes_.end()) ep->lanes_.push_back(lane);
      }
    }
  }
  return ep;
}

Result<std::vector<std::string>> UcxWorker::lanesToSelf() {
  Result<std::unique_ptr<UcxEndpoint>> ep = connect(address_);
  if (!ep.ok()) return ep.status();
  return ep.value()->lanes();  // the endpoint is closed by force as it goes
}

Status UcxWorker::setHandler(unsigned id, Handler handler) {
  handlers_.push_back(std::unique_ptr<HandlerSlot>(new HandlerSlot{this, std::move(handler)}));
  AmHandlerParam param;
  param.field_mask = kAmHandlerParamFieldId | kAmHandlerParamFieldCb | kAmHandlerParamFieldArg;
  param.id = id;
  param.cb = &UcxWorker::onMessage;
  param.arg = handlers_.back().get();
  ucs_status_t st = api_->ucp_worker_set_am_recv_handler(worker_, &param);
  return st == kOk ? Status::OK() : toStatus(st, "ucx: setting a message handler");
}

ucs_status_t UcxWorker::onMessage(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const AmRecvParam* param) {
  auto* slot = static_cast<HandlerSlot*>(arg);
  AmIncoming in;
  in.header = static_cast<const uint8_t*>(header);
  in.header_length = header_length;
  in.length = length;
  in.rendezvous = (param->recv_attr & kAmRecvAttrFlagRndv) != 0;
  in.worker_ = slot->worker;
  in.data_ = data;
  slot->handler(in);
  // Received or not, nothing of the message is kept: an eager message's bytes were copied (or are
  // dropped), a rendezvous descriptor was handed to ucp_am_recv_data_nbx (or is dropped, which
  // completes the sender's request).
  return kOk;
}

void AmIncoming::receiveInto(void* buffer, std::function<void(Status)> done) {
  if (taken_) {
    done(Status(Code::kParamInvalid, "ucx: a message is received once"));
    return;
  }
  taken_ = true;
  if (!rendezvous) {
    if (length > 0) std::memcpy(buffer, data_, length);
    done(Status::OK());
    return;
  }
  struct Pending {
    const UcpApi* api;
    std::function<void(Status)> done;
  };
  const UcpApi* api = worker_->api_;
  // The completion callback owns this from here and frees it.
  auto* pending = new Pending{api, std::move(done)};
  RequestParam param;
  param.op_attr_mask = kOpAttrFieldCallback | kOpAttrFieldUserData;
  ucp_am_recv_data_nbx_callback_t cb = [](void* request, ucs_status_t status, size_t, void* user_data) {
    std::unique_ptr<Pending> p(static_cast<Pending*>(user_data));
    p->api->ucp_request_free(request);
    p->done(status == kOk ? Status::OK() : toStatus(status, "ucx: receiving a message"));
  };
  param.cb = reinterpret_cast<void*>(cb);
  param.user_data = pending;
  ucs_status_ptr_t req = api->ucp_am_recv_data_nbx(worker_->worker_, data_, buffer, length, &param);
  if (ptrIsPtr(req)) return;  // the callback reports it
  std::unique_ptr<Pending> p(pending);
  ucs_status_t st = ptrStatus(req);
  p->done(st == kOk ? Status::OK() : toStatus(st, "ucx: receiving a message"));
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
  // A small message completes within microseconds, a large one as fast as the transport moves it:
  // spinning on progress keeps latency at UCX's own. The deadline bounds the spin.
  for (uint32_t spins = 0;; ++spins) {
    api_->ucp_worker_progress(worker_);
    st = api_->ucp_request_check_status(request);
    if (st != kInProgress) break;
    if ((spins & 63) == 0 && deadline.expired()) return kErrTimedOut;
  }
  api_->ucp_request_free(request);
  return st;
}

// ------------------------------------------------------------------------------ UcxEndpoint

void UcxEndpoint::onError(void* arg, ucp_ep_h, ucs_status_t status) {
  __atomic_store_n(&static_cast<UcxEndpoint*>(arg)->error_, status == kOk ? kErrConnectionReset : status,
                   __ATOMIC_RELEASE);
}

bool UcxEndpoint::failed() const { return __atomic_load_n(&error_, __ATOMIC_ACQUIRE) != 0; }

Status UcxEndpoint::send(unsigned id, const void* header, size_t header_length, const void* data, size_t length,
                         Deadline deadline) {
  const UcpApi* api = worker_->api_;
  if (ep_ == nullptr) return Status(Code::kLinkFailed, "ucx send: the endpoint was closed");
  if (failed()) return toStatus(__atomic_load_n(&error_, __ATOMIC_ACQUIRE), "ucx send");
  RequestParam param;
  ucs_status_ptr_t req = api->ucp_am_send_nbx(ep_, id, header, header_length, data, length, &param);
  ucs_status_t st = worker_->wait(req, deadline);
  if (st == kErrTimedOut) {
    // Closing by force completes the pending send (with an error), which can then be freed.
    closeForce();
    while (api->ucp_request_check_status(req) == kInProgress) api->ucp_worker_progress(worker_->worker_);
    api->ucp_request_free(req);
    return Status(Code::kTimeout, "ucx send: not complete by the deadline; the endpoint was closed");
  }
  if (st != kOk) return toStatus(failed() ? __atomic_load_n(&error_, __ATOMIC_ACQUIRE) : st, "ucx send");
  return Status::OK();
}

Status UcxEndpoint::sendAll(unsigned id, const std::vector<Message>& messages, size_t window, Deadline deadline) {
  const UcpApi* api = worker_->api_;
  if (ep_ == nullptr) return Status(Code::kLinkFailed, "ucx send: the endpoint was closed");
  if (failed()) return toStatus(__atomic_load_n(&error_, __ATOMIC_ACQUIRE), "ucx send");
  RequestParam param;
  param.op_attr_mask = kOpAttrFieldFlags;
  param.flags = kAmSendFlagEager;
  std::vector<ucs_status_ptr_t> pending;  // in flight, oldest first
  ucs_status_t st = kOk;
  size_t next = 0, done = 0;
  while (st == kOk && done < messages.size()) {
    while (next < messages.size() && next - done < std::max<size_t>(window, 1)) {
      const Message& m = messages[next++];
      ucs_status_ptr_t req = api->ucp_am_send_nbx(ep_, id, m.header, m.header_length, m.data, m.length, &param);
      pending.push_back(req);
    }
    st = worker_->wait(pending[done], deadline);  // frees it once complete
    if (st == kErrTimedOut) break;                // still in flight: freed below
    pending[done++] = nullptr;
  }
  if (st == kOk) return Status::OK();
  // Past the deadline or failed: closing by force completes what is still pending (with an
  // error), which can then be freed; nothing of it reads the callers' buffers after this returns.
  closeForce();
  for (size_t i = done; i < next; ++i) {
    if (!ptrIsPtr(pending[i])) continue;
    while (api->ucp_request_check_status(pending[i]) == kInProgress) api->ucp_worker_progress(worker_->worker_);
    api->ucp_request_free(pending[i]);
  }
  if (st == kErrTimedOut) return Status(Code::kTimeout, "ucx send: not complete by the deadline; the endpoint was closed");
  return toStatus(failed() ? __atomic_load_n(&error_, __ATOMIC_ACQUIRE) : st, "ucx send");
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

}  // namespace pdlink::ucx
