// A model of UCX's own reading of a worker address, for the fuzz target: ucp_address_unpack of
// ucp/wireup/address.c (UCX 1.12 .. 1.22, non-unified mode, the unpack flags of ucp_ep_create:
// worker uuid, worker name, device, interface and endpoint addresses), transliterated line by line
// with its pointer walk and without a single bounds check, as UCX has none. Run on a buffer of
// exactly the address's bytes under AddressSanitizer: an address that the check accepted but that
// UCX would read past the end of makes ASan stop the run. Returns false where UCX returns an error
// (too many entries, a bandwidth <= 0) or aborts (an unknown version); fills what it unpacked.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdlink::fuzz {

struct ModelEntry {
  uint16_t tl_name_csum;
  unsigned md_index;
  size_t dev_addr_len;
  size_t iface_addr_len;
  size_t num_ep_addrs;
  bool dev_addr_null;    // UCX: (dev_addr_len > 0) ? dev_addr : NULL
  bool iface_addr_null;  // UCX: (iface_addr_len > 0) ? ptr : NULL
};

struct ModelResult {
  const uint8_t* end = nullptr;  // where UCX's walk stopped
  bool empty_list = false;
  unsigned addr_version = 0, dst_version = 0;
  std::vector<ModelEntry> entries;
};

namespace model {

inline unsigned unpackReleaseVersion(uint8_t packed, unsigned api_minor) {
  int range = 16;
  int delta = static_cast<int>(api_minor % 16) - packed;
  int base = static_cast<int>(api_minor / range) + (delta >= range / 2) - (delta <= -range / 2);
  return packed + (base > 0 ? base : 0) * range;
}

// ucp_address_unpack_byte_extended
inline const uint8_t* unpackByteExtended(const uint8_t* ptr, uint8_t value_mask, unsigned addr_version,
                                         uint8_t* value_p) {
  uint8_t value = *ptr++ & value_mask;
  if (addr_version != 0 && value == value_mask) value = *ptr++;
  *value_p = value;
  return ptr;
}

}  // namespace model

// `api_minor`: the UCX release reading the address (1.api_minor).
inline bool unpackLikeUcx(const uint8_t* buffer, unsigned api_minor, ModelResult* out) {
  using namespace model;
  const uint8_t* ptr = buffer;
  // ucp_address_unpack_header
  unsigned addr_version = *ptr & 0x0f;
  uint8_t addr_flags;
  unsigned dst_version;
  if (addr_version == 0) {
    addr_flags = *ptr >> 4;
    dst_version = 0;
    ptr += 1;
  } else if (addr_version == 1) {
    addr_flags = ptr[1];
    dst_version = unpackReleaseVersion(*ptr >> 4, api_minor);
    ptr += 2;
  } else {
    return false;  // ucs_assertv_always: UCX aborts
  }
  // uuid: v1 with the WORKER_UUID unpack flag (always for ucp_ep_create), or the header flag
  if (addr_version == 0 || (addr_flags & 2)) ptr += 8;
  if (addr_flags & 4) ptr += 8;  // client id
  if (addr_flags & 1) {          // debug info, with the WORKER_NAME unpack flag
    size_t length = *ptr;
    ptr += 1 + length;
  }
  if (*ptr == 0xff) {  // UCP_NULL_RESOURCE: an empty address list
    out->empty_list = true;
    out->end = ptr;  // UCX stops reading here (it never looks past)
    out->addr_version = addr_version;
    return true;
  }
  const uint8_t md_mask = (api_minor < 19 && addr_version == 0) ? 0x1f : 0x7f;
  size_t count = 0;
  int last_dev;
  do {
    // ucp_address_unpack_md_info
    uint8_t md_byte = *ptr;
    int empty_dev = md_byte & 0x80;
    uint8_t md_index;
    ptr = unpackByteExtended(ptr, md_mask, addr_version, &md_index);
    // device address length
    uint8_t flags = *ptr & 0xe0;
    last_dev = flags & 0x80;
    uint8_t dev_addr_len;
    ptr = unpackByteExtended(ptr, 0x1f, addr_version, &dev_addr_len);
    if (flags & 0x40) {
      (void)*ptr;  // dev_num_paths
      ptr += 1;
    }
    if (flags & 0x20) {
      (void)*ptr;  // sys_dev
      ptr += 1;
    }
    if (empty_dev && last_dev) dst_version = unpackReleaseVersion(md_index & 0x0f, api_minor);
    const uint8_t* dev_addr = ptr;
    ptr += dev_addr_len;
    int last_tl = empty_dev;
    while (!last_tl) {
      if (count >= 128) return false;  // "number of addresses exceeds"
      ModelEntry e{};
      uint16_t csum;
      std::memcpy(&csum, ptr, 2);
      e.tl_name_csum = csum;
      ptr += 2;
      e.dev_addr_len = dev_addr_len;
      e.dev_addr_null = dev_addr_len == 0;
      e.md_index = md_index;
      // ucp_address_unpack_iface_attr
      size_t attr_len;
      if (addr_version == 0) {
        float bandwidth;
        std::memcpy(&bandwidth, ptr + 4, 4);
        uint32_t prio_cap_flags;
        std::memcpy(&prio_cap_flags, ptr + 12, 4);
        (void)prio_cap_flags;
        if (bandwidth < 0) bandwidth = std::fabs(bandwidth);           // rescaled by UCX, stays > 0
        if (!(bandwidth > 0) && !std::isnan(bandwidth)) return false;  // "invalid bandwidth"
        attr_len = 16;
      } else {
        (void)ptr[7];
        attr_len = 8;  // a zero bandwidth (fp8) is refused by UCX too; not modelled
      }
      const uint8_t* flags_ptr = ptr + attr_len;
      ptr += attr_len;
      // ucp_address_unpack_tl_length (an interface address)
      last_tl = *ptr & 0x80;
      uint8_t iface_addr_len;
      ptr = unpackByteExtended(ptr, 0x3f, addr_version, &iface_addr_len);
      e.iface_addr_len = iface_addr_len;
      e.iface_addr_null = iface_addr_len == 0;
      ptr += iface_addr_len;
      int last_ep_addr = !(*flags_ptr & 0x40);
      while (!last_ep_addr) {
        if (e.num_ep_addrs >= 64) return false;  // UCP_MAX_LANES
        uint8_t ep_addr_len = *ptr++;
        ptr += ep_addr_len;
        last_ep_addr = *ptr & 0x80;
        ptr += 1;
        ++e.num_ep_addrs;
      }
      (void)dev_addr;
      out->entries.push_back(e);
      ++count;
    }
  } while (!last_dev);
  // ucp_address_adjust_unpacked_md_index (UCX 1.19 on)
  if (api_minor >= 19 && addr_version == 0 && dst_version <= 18) {
    for (ModelEntry& e : out->entries) e.md_index &= ~0x60u;
  }
  out->end = ptr;
  out->addr_version = addr_version;
  out->dst_version = dst_version;
  return true;
}

}  // namespace pdlink::fuzz
