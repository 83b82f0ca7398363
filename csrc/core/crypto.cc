#include "core/crypto.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "core/environment.h"

namespace pdlink {

bool constantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len) {
  uint8_t diff = 0;
  for (size_t i = 0; i < len; ++i) diff |= static_cast<uint8_t>(a[i] ^ b[i]);
  return diff == 0;
}

namespace crypto {
namespace {

// The few OpenSSL 3 declarations used here (EVP_MAC, <openssl/evp.h>, <openssl/params.h>), in our
// own words: no OpenSSL header is needed to build pdlink.
struct OsslParam {
  const char* key;
  unsigned int data_type;
  void* data;
  size_t data_size;
  size_t return_size;
};
constexpr unsigned int kParamUtf8String = 4;   // OSSL_PARAM_UTF8_STRING
constexpr size_t kParamUnmodified = SIZE_MAX;  // OSSL_PARAM_UNMODIFIED

struct Api {
  void* (*EVP_MAC_fetch)(void* libctx, const char* algorithm, const char* properties) = nullptr;
  void* (*EVP_MAC_CTX_new)(void* mac) = nullptr;
  void (*EVP_MAC_CTX_free)(void* ctx) = nullptr;
  void* (*EVP_MAC_CTX_dup)(const void* ctx) = nullptr;
  int (*EVP_MAC_init)(void* ctx, const unsigned char* key, size_t keylen, const OsslParam params[]) = nullptr;
  int (*EVP_MAC_update)(void* ctx, const unsigned char* data, size_t len) = nullptr;
  int (*EVP_MAC_final)(void* ctx, unsigned char* out, size_t* outl, size_t outsize) = nullptr;
  void* hmac = nullptr;  // the fetched HMAC algorithm, kept for the process's life
  std::string path;
  Status status;
};

const Api& api() {
  static Api* a = [] {
    auto* out = new Api;
    const std::optional<std::string> forced_name = environment::read(environment::kLibcrypto);
    const char* forced = forced_name ? forced_name->c_str() : nullptr;
    const char* names[] = {"libcrypto.so.3", "libcrypto.so"};
    void* lib = nullptr;
    std::string tried;
    if (forced && *forced) {
      lib = ::dlopen(forced, RTLD_NOW | RTLD_LOCAL);
      tried = forced;
      if (lib) out->path = forced;
    } else {
      for (const char* n : names) {
        lib = ::dlopen(n, RTLD_NOW | RTLD_LOCAL);
        tried += (tried.empty() ? "" : ", ") + std::string(n);
        if (lib) {
          out->path = n;
          break;
        }
      }
    }
    if (!lib) {
      const char* why = ::dlerror();
      out->status = Status(Code::kFeatureNotEnabled,
                           "a link secret needs the system's libcrypto (OpenSSL 3), which could not be loaded (tried " +
                               tried + (why ? std::string("; ") + why : std::string()) +
                               "): install libssl3, or set PDLINK_LIBCRYPTO to its path");
      return out;
    }
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      if (!fn) missing += (missing.empty() ? "" : ", ") + std::string(name);
    };
    bind(out->EVP_MAC_fetch, "EVP_MAC_fetch");
    bind(out->EVP_MAC_CTX_new, "EVP_MAC_CTX_new");
    bind(out->EVP_MAC_CTX_free, "EVP_MAC_CTX_free");
    bind(out->EVP_MAC_CTX_dup, "EVP_MAC_CTX_dup");
    bind(out->EVP_MAC_init, "EVP_MAC_init");
    bind(out->EVP_MAC_update, "EVP_MAC_update");
    bind(out->EVP_MAC_final, "EVP_MAC_final");
    if (!missing.empty()) {
      out->status = Status(Code::kFeatureNotEnabled, out->path + " is not OpenSSL 3 (missing " + missing +
                                                         "): a link secret needs OpenSSL 3's libcrypto");
      return out;
    }
    out->hmac = out->EVP_MAC_fetch(nullptr, "HMAC", nullptr);
    if (!out->hmac) out->status = Status(Code::kFeatureNotEnabled, out->path + " has no HMAC (EVP_MAC_fetch failed)");
    return out;
  }();
  return *a;
}

// A fresh HMAC-SHA256 context keyed with `key`, or nullptr.
void* keyedContext(const Api& a, const std::string& key) {
  void* ctx = a.EVP_MAC_CTX_new(a.hmac);
  if (!ctx) return nullptr;
  char digest[] = "SHA256";
  OsslParam params[2] = {{"digest", kParamUtf8String, digest, sizeof(digest) - 1, kParamUnmodified},
                         {nullptr, 0, nullptr, 0, 0}};
  // An empty key is valid HMAC, but OpenSSL wants a non-null pointer for it.
  static const unsigned char kEmpty = 0;
  const unsigned char* k = key.empty() ? &kEmpty : reinterpret_cast<const unsigned char*>(key.data());
  if (a.EVP_MAC_init(ctx, k, key.size(), params) != 1) {
    a.EVP_MAC_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

}  // namespace

Status available() { return api().status; }

std::string libraryPath() { return api().status.ok() ? api().path : std::string(); }

Result<Digest> hmacSha256(const std::string& key, const void* data, size_t len) {
  auto k = Key::create(key);
  if (!k.ok()) return k.status();
  auto mac = k.value()->start();
  if (!mac.ok()) return mac.status();
  mac.value().update(data, len);
  return mac.value().finish();
}

Result<std::shared_ptr<const Key>> Key::create(const std::string& key) {
  const Api& a = api();
  if (!a.status.ok()) return a.status;
  std::shared_ptr<Key> k(new Key());
  k->ctx_ = keyedContext(a, key);
  if (!k->ctx_) return Status(Code::kFailed, "libcrypto could not set up an HMAC-SHA256 key");
  return std::shared_ptr<const Key>(std::move(k));
}

Key::~Key() {
  if (ctx_) api().EVP_MAC_CTX_free(ctx_);
}

Result<Key::Mac> Key::start() const {
  void* ctx = api().EVP_MAC_CTX_dup(ctx_);
  if (!ctx) return Status(Code::kFailed, "libcrypto could not start an HMAC computation");
  return Mac(ctx);
}

Key::Mac::~Mac() {
  if (ctx_) api().EVP_MAC_CTX_free(ctx_);
}

void Key::Mac::update(const void* data, size_t len) {
  if (len) api().EVP_MAC_update(ctx_, static_cast<const unsigned char*>(data), len);
}

Digest Key::Mac::finish() {
  Digest out{};
  size_t n = 0;
  api().EVP_MAC_final(ctx_, out.data(), &n, out.size());
  return out;
}

}  // namespace crypto
}  // namespace pdlink
