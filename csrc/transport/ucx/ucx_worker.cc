// UCP contexts, workers, endpoints and mapped memory (transport/ucx/ucx_worker.h).
#include "transport/ucx/ucx_worker.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <set>
#include <vector>

#include "core/environment.h"

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

Result<std::string> transportsFor(WorkerScope scope, const char* user) {
  std::string tls = user ? user : "";
  if (scope == WorkerScope::kAny) return tls;  // "" (unset or empty): UCX's default, all
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
                  "UCX_TLS=" + tls +
                      " names no network transport, and a peer not proven to be on this host "
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
  const std::optional<std::string> setting = environment::read(environment::kUcxAutoTransports);
  return anyLaneOf(network_lanes, autoFamilies(setting ? setting->c_str() : nullptr));
}

// ------------------------------------------------------------------------------ worker addresses

namespace {

// Reads a worker address front to back, never past its end.
class AddressReader {
 public:
  AddressReader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  size_t at() const { return at_; }
  bool done() const { return at_ == n_; }
  bool byte(uint8_t* out) {
    if (at_ >= n_) return false;
    *out = p_[at_++];
    return true;
  }
  const uint8_t* take(size_t bytes) {  // null when fewer are left
    if (bytes > n_ - at_) return nullptr;
    const uint8_t* out = p_ + at_;
    at_ += bytes;
    return out;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t at_ = 0;
};

Status malformed(size_t at, const std::string& what) {
  return Status(Code::kParamInvalid, "malformed ucx worker address at byte " + std::to_string(at) + ": " + what);
}

// UCX's ucp_address_unpack_release_version: a 4-bit release, taken as the nearest to this one's.
unsigned unpackRelease(unsigned packed, unsigned minor) {
  const int range = 16;
  const int delta = static_cast<int>(minor % range) - static_cast<int>(packed);
  const int base = static_cast<int>(minor / range) + (delta >= range / 2) - (delta <= -range / 2);
  return packed + static_cast<unsigned>(std::max(0, base)) * range;
}

constexpr uint8_t kFlagLast = 0x80;         // last device (dev len), last transport (iface len)
constexpr uint8_t kFlagHasEpAddr = 0x40;    // iface len: endpoint addresses follow
constexpr uint8_t kFlagNumPaths = 0x40;     // dev len: a paths byte follows
constexpr uint8_t kFlagSysDevice = 0x20;    // dev len: a system-device byte follows
constexpr uint8_t kFlagEmptyDevice = 0x80;  // md byte: the device lists no transports
constexpr uint8_t kHeaderDebugInfo = 1, kHeaderUuid = 2, kHeaderClientId = 4, kHeaderKnown = 0x0f;
constexpr unsigned kAttrAmSync = 2;           // v2 attribute flags: UCP_ADDR_IFACE_FLAG_AM_SYNC
constexpr unsigned kMinAmSegmentBytes = 512;  // UCX's own are 8 KiB (tcp, shared memory), ~4 KiB (ud)
constexpr size_t kMaxResources = 128;         // UCP_MAX_RESOURCES
constexpr unsigned kMaxMds = 64;              // UCP_MAX_MDS
constexpr unsigned kLegacyMdRelease = 18;     // UCX >= 1.19 clears bits 5-6 of md indexes from <= 1.18

// parseWorkerAddress's steps. The header: version, flags, then the worker uuid, client id and name
// the flags announce; *release: the sender's release as a v2 header packs it (v1: 0 here).
Status readAddressHeader(AddressReader& r, unsigned minor, WorkerAddressLayout* out, unsigned* release) {
  uint8_t header = 0, flags = 0;
  (void)r.byte(&header);
  out->version = header & 0x0f;
  if (out->version == 0) {
    flags = header >> 4;
  } else if (out->version == 1) {
    if (!r.byte(&flags)) return malformed(r.at(), "no flags byte");
    *release = unpackRelease(header >> 4, minor);
  } else {
    return malformed(0,
                     "address version " + std::to_string(out->version) + " (UCX knows v1 and v2; it aborts on others)");
  }
  if (flags & ~kHeaderKnown) return malformed(r.at() - 1, "unknown header flags " + std::to_string(flags));
  if ((out->version == 0 || (flags & kHeaderUuid)) && !r.take(8)) return malformed(r.at(), "no worker uuid");
  if ((flags & kHeaderClientId) && !r.take(8)) return malformed(r.at(), "no client id");
  if (flags & kHeaderDebugInfo) {
    uint8_t len = 0;
    if (!r.byte(&len) || !r.take(len)) return malformed(r.at(), "a worker name past the end");
  }
  return Status::OK();
}

// One transport of a device: its name checksum, attributes (checked as UCX would trip on them) and
// interface address; *last_tl: it is the device's last.
Status readTransport(AddressReader& r, bool v2, AddressEntry* e, bool* last_tl) {
  const size_t tl_at = r.at();
  const uint8_t* csum = r.take(2);
  if (!csum) return malformed(tl_at, "a transport past the end");
  e->tl_name_csum = static_cast<uint16_t>(csum[0] | csum[1] << 8);
  const uint8_t* attr = r.take(v2 ? 8 : 16);
  if (!attr) return malformed(tl_at, "transport attributes past the end");
  if (!v2) {
    float overhead, bandwidth, latency;
    std::memcpy(&overhead, attr, 4);
    std::memcpy(&bandwidth, attr + 4, 4);
    std::memcpy(&latency, attr + 8, 4);
    if (!std::isfinite(overhead) || !std::isfinite(bandwidth) || !std::isfinite(latency) || bandwidth == 0) {
      return malformed(tl_at, "transport attributes that are not finite, or a zero bandwidth");
    }
  } else {
    // The segment a v2 peer can receive bounds the messages UCX sends it on an AM lane, and UCX
    // aborts when its rendezvous keys do not fit in one (ucp_ep.c: rkey_size <= am.max_bcopy).
    const unsigned seg_bytes = (attr[4] | attr[5] << 8) * 64u, flags16 = attr[6] | attr[7] << 8;
    if ((flags16 & kAttrAmSync) && seg_bytes < kMinAmSegmentBytes) {
      return malformed(tl_at, "an active-message transport whose segment is " + std::to_string(seg_bytes) +
                                  " bytes (at least " + std::to_string(kMinAmSegmentBytes) + ")");
    }
  }
  uint8_t len = 0;
  if (!r.byte(&len)) return malformed(r.at(), "an interface length past the end");
  *last_tl = len & kFlagLast;
  if (len & kFlagHasEpAddr) return malformed(r.at() - 1, "endpoint addresses (a worker address has none)");
  size_t iface_len = len & 0x3f;
  if (v2 && iface_len == 0x3f) {
    uint8_t full = 0;
    if (!r.byte(&full)) return malformed(r.at(), "an interface length past the end");
    iface_len = full;
  }
  if (!r.take(iface_len)) return malformed(r.at(), "an interface address past the end");
  e->iface_addr_len = iface_len;
  return Status::OK();
}

// One device: its md index, device address and, unless it is empty, its transports (into
// out->entries; [first, end) of them into *device_entries). A v1 sender's release comes from its
// last empty device (*release); *last_device: it is the last.
Status readDevice(AddressReader& r, bool v2, uint8_t md_mask, unsigned minor, WorkerAddressLayout* out,
                  unsigned* release, std::vector<std::pair<size_t, size_t>>* device_entries, bool* last_device) {
  const size_t device_at = r.at();
  if (++out->devices > kMaxResources) return malformed(device_at, "more than 128 devices");
  uint8_t md = 0, dev = 0;
  if (!r.byte(&md)) return malformed(r.at(), "a device past the end");
  const bool empty = md & kFlagEmptyDevice;
  unsigned md_index = md & md_mask;
  if (v2 && md_index == 0x7f) {  // extended: the whole next byte
    uint8_t full = 0;
    if (!r.byte(&full)) return malformed(r.at(), "an md index past the end");
    md_index = full;
  }
  if (!r.byte(&dev)) return malformed(r.at(), "a device length past the end");
  *last_device = dev & kFlagLast;
  size_t dev_len = dev & 0x1f;
  if (v2 && dev_len == 0x1f) {
    uint8_t full = 0;
    if (!r.byte(&full)) return malformed(r.at(), "a device length past the end");
    dev_len = full;
  }
  uint8_t extra = 0;
  if ((dev & kFlagNumPaths) && (!r.byte(&extra) || extra == 0)) return malformed(r.at(), "no paths or 0 paths");
  if ((dev & kFlagSysDevice) && !r.byte(&extra)) return malformed(r.at(), "a system device past the end");
  if (empty && *last_device && !v2) *release = unpackRelease(md_index & 0x0f, minor);
  if (!r.take(dev_len)) return malformed(r.at(), "a device address past the end");
  if (empty) return Status::OK();
  const size_t first = out->entries.size();
  for (bool last_tl = false; !last_tl;) {
    if (out->entries.size() >= kMaxResources) return malformed(r.at(), "more than 128 transports");
    AddressEntry e;
    e.md_index = md_index;
    e.dev_addr_len = dev_len;
    PDLINK_RETURN_IF_ERROR(readTransport(r, v2, &e, &last_tl));
    out->entries.push_back(e);
  }
  device_entries->emplace_back(first, out->entries.size());
  return Status::OK();
}

}  // namespace

Result<WorkerAddressLayout> parseWorkerAddress(const uint8_t* p, size_t n, unsigned minor) {
  if (minor < kAddressMinorFirst || minor > kAddressMinorLast) {
    return Status(Code::kFeatureNotEnabled,
                  "ucx worker addresses of UCX 1." + std::to_string(minor) + " are not a layout pdlink knows (UCX 1." +
                      std::to_string(kAddressMinorFirst) + " .. 1." + std::to_string(kAddressMinorLast) + ")");
  }
  if (n == 0) return malformed(0, "empty");
  if (n > kMaxWorkerAddressBytes)
    return malformed(0, std::to_string(n) + " bytes, more than " + std::to_string(kMaxWorkerAddressBytes));
  AddressReader r(p, n);
  WorkerAddressLayout out;
  unsigned release = 0;  // the sender's, as UCX reads it (v1: from its last empty device, else 0)
  PDLINK_RETURN_IF_ERROR(readAddressHeader(r, minor, &out, &release));
  if (r.at() < n && p[r.at()] == 0xff) return malformed(r.at(), "no devices");
  const bool v2 = out.version == 1;
  // 1.12 .. 1.18 read a v1 md index from bits 0-4 (bits 5-6 were flags); 1.19 on from bits 0-6,
  // clearing bits 5-6 afterwards when the sender is 1.18 or older.
  const uint8_t md_mask = (!v2 && minor < 19) ? 0x1f : 0x7f;
  std::vector<std::pair<size_t, size_t>> device_entries;  // per device with transports: [first, end) of entries
  for (bool last_device = false; !last_device;) {
    PDLINK_RETURN_IF_ERROR(readDevice(r, v2, md_mask, minor, &out, &release, &device_entries, &last_device));
  }
  if (!r.done()) return malformed(r.at(), std::to_string(n - r.at()) + " bytes after the last device");
  if (out.entries.empty()) return malformed(n, "no transports");
  for (AddressEntry& e : out.entries) {
    if (!v2 && minor >= 19 && release <= kLegacyMdRelease) e.md_index &= ~0x60u;
    if (e.md_index >= kMaxMds) return malformed(0, "md index " + std::to_string(e.md_index) + " (UCX has 64)");
  }
  return out;
}

Status checkWorkerAddress(const uint8_t* p, size_t n, unsigned minor, const WorkerAddressLayout& own) {
  Result<WorkerAddressLayout> parsed = parseWorkerAddress(p, n, minor);
  if (!parsed.ok()) return parsed.status();
  for (const AddressEntry& e : parsed.value().entries) {
    bool known = false, needs_dev = true, needs_iface = true;
    for (const AddressEntry& mine : own.entries) {
      if (mine.tl_name_csum != e.tl_name_csum) continue;
      known = true;
      needs_dev = needs_dev && mine.dev_addr_len > 0;
      needs_iface = needs_iface && mine.iface_addr_len > 0;
    }
    if (known && ((needs_dev && e.dev_addr_len == 0) || (needs_iface && e.iface_addr_len == 0))) {
      return Status(Code::kParamInvalid, "malformed ucx worker address: a transport (checksum " +
                                             std::to_string(e.tl_name_csum) + ") without the " +
                                             (needs_dev && e.dev_addr_len == 0 ? "device" : "interface") +
                                             " address this UCX reads for it");
    }
  }
  return Status::OK();
}

// ------------------------------------------------------------------------------ UcxWorker

Result<std::unique_ptr<UcxWorker>> UcxWorker::open(WorkerScope scope) {
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
  // Unified mode reads a peer's address by this side's own resource indexes (an index it does not
  // have is read anyway): never, whatever UCX_UNIFIED_MODE says (checkWorkerAddress reads the
  // other layout).
  if (st == kOk) st = api->ucp_config_modify(config, "UNIFIED_MODE", "n");
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
  attr.address_flags = scope == WorkerScope::kNetwork ? kWorkerAddressFlagNetOnly : 0;
  st = api->ucp_worker_query(w->worker_, &attr);
  if (st != kOk) return toStatus(st, "ucx: reading the worker's address");
  w->address_.assign(reinterpret_cast<const char*>(attr.address), attr.address_length);
  api->ucp_worker_release_address(w->worker_, attr.address);
  // Peers' addresses are checked against this layout before UCX reads them (connect): a UCX whose
  // own addresses it cannot read is one whose peers' addresses cannot be checked either.
  w->minor_ = api->minor;
  Result<WorkerAddressLayout> own =
      parseWorkerAddress(reinterpret_cast<const uint8_t*>(w->address_.data()), w->address_.size(), w->minor_);
  if (!own.ok()) {
    return Status(Code::kFeatureNotEnabled, "ucx: UCX " + api->version +
                                                " cannot be used: pdlink checks every "
                                                "worker address a peer sends before UCX reads it, and " +
                                                own.status().message());
  }
  w->own_layout_ = std::move(own.value());

  st = api->ucp_worker_get_efd(w->worker_, &w->efd_);
  if (st != kOk) return toStatus(st, "ucx: reading the worker's event fd");
  return w;
}

UcxWorker::~UcxWorker() {
  if (worker_ != nullptr) api_->ucp_worker_destroy(worker_);
  if (context_ != nullptr) api_->ucp_cleanup(context_);
}

Result<std::unique_ptr<UcxEndpoint>> UcxWorker::connect(const std::string& peer_address) {
  // Nothing a peer sent reaches UCX unchecked: UCX aborts on, or reads past, what it cannot parse.
  Status valid = checkWorkerAddress(reinterpret_cast<const uint8_t*>(peer_address.data()), peer_address.size(), minor_,
                                    own_layout_);
  if (!valid.ok()) return Status(Code::kParamInvalid, "ucx: the peer's worker address was refused: " + valid.message());
  std::string padded = peer_address;
  padded.append(kAddressPadBytes, '\0');
  std::unique_ptr<UcxEndpoint> ep(new UcxEndpoint(this));
  EpParams params;
  params.field_mask = kEpParamFieldRemoteAddress | kEpParamFieldErrHandlingMode | kEpParamFieldErrHandler;
  params.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  if (scope_ == WorkerScope::kAny) {
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
        std::string lane =
            std::string(entries[i].transport_name) + "/" + (entries[i].device_name ? entries[i].device_name : "");
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
  if (st == kErrTimedOut)
    return Status(Code::kTimeout, "ucx send: not complete by the deadline; the endpoint was closed");
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
