// SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104), for the link handshake's challenge-response.
//
// Kept in the core so that the wheel needs no system crypto library; verified against Python's
// hashlib/hmac in tests/test_auth.py. Not for bulk hashing: it is a straightforward, portable
// implementation, fast enough for a few hundred bytes per link.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pdlink {

using Digest = std::array<uint8_t, 32>;

Digest sha256(const void* data, size_t len);
Digest hmacSha256(const std::string& key, const void* data, size_t len);
// Compares without an early exit, so the time taken does not tell how many bytes matched.
bool constantTimeEqual(const uint8_t* a, const uint8_t* b, size_t len);

}  // namespace pdlink
