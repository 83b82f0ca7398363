// Crypto: HMAC-SHA256 from the system's libcrypto (OpenSSL 3), loaded at run time on first use.
//
// pdlink needs it only for links with a secret (the handshake's proofs, the session keys and the
// tag of every frame, transport/link.h); an engine without a secret never loads it, so the wheel links
// no crypto library. The library is looked up as $PDLINK_LIBCRYPTO when set (a path; no fallback),
// else as "libcrypto.so.3", then "libcrypto.so". When it cannot be loaded, every function returns
// kFeatureNotEnabled naming what is missing and where it looked.
// Threading: all functions are thread-safe; a Mac is used by one thread at a time.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace pdlink {

using Digest = std::array<uint8_t, 32>;

// Compares without an early exit, so the time taken does not tell how many bytes matched.
bool constantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len);

namespace crypto {

// OK when libcrypto is loaded (loading it on the first call), else why not.
Status available();
// Where it was loaded from, or the empty string.
std::string libraryPath();

Result<Digest> hmacSha256(const std::string& key, const void* data, size_t len);

// An HMAC-SHA256 key, set up once; every Mac started from it computes one tag.
class Key {
 public:
  static Result<std::shared_ptr<const Key>> create(const std::string& key);
  ~Key();
  Key(const Key&) = delete;
  Key& operator=(const Key&) = delete;

  class Mac {
   public:
    Mac(Mac&& other) noexcept : ctx_(other.ctx_) { other.ctx_ = nullptr; }
    Mac& operator=(Mac&&) = delete;
    ~Mac();
    void update(const void* data, size_t len);
    // The tag; the Mac may not be used afterwards.
    Digest finish();

   private:
    friend class Key;
    explicit Mac(void* ctx) : ctx_(ctx) {}
    void* ctx_;
  };
  // A fresh computation under this key. Fails only when libcrypto runs out of memory.
  Result<Mac> start() const;

 private:
  Key() = default;
  void* ctx_ = nullptr;  // a keyed EVP_MAC_CTX, duplicated by start()
};

}  // namespace crypto
}  // namespace pdlink
