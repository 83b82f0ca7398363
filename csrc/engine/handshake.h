// The handshake of a link's two channels (transport/wire.h has the frames; docs/security.md the
// scheme): both sides build the same transcript, prove the link secret over it, and derive each
// channel's session key from it. Internal to the engine (link_manager.cc, handshake.cc).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/crypto.h"
#include "core/deadline.h"
#include "core/status.h"
#include "transport/socket.h"
#include "transport/wire.h"

namespace pdlink::detail {

// 128 bits from the OS CSPRNG (getrandom) pairing the two channels of one link attempt.
wire::Nonce makeNonce();
void randomBytes(uint8_t* out, size_t n);
// The handshake transcript of one channel, as both sides see it (transport/wire.h): the Hello
// frame as sent, the acceptor's cluster id and challenge; then what ClientAuth says besides its
// proof; then the channel kind and the verdict. Proofs and the session key cover it.
class Transcript {
 public:
  void addHello(const std::string& hello_frame, uint64_t server_id, const uint8_t* server_challenge);
  void addClientAuth(const wire::ClientAuth& auth);
  void addVerdict(bool unix_channel, const wire::AuthResult& result);
  const std::string& bytes() const { return bytes_; }

 private:
  void add(const void* data, size_t len);
  template <class T>
  void add(T v) {
    add(&v, sizeof(v));
  }
  std::string bytes_;
};
// The proof of one side ('S' acceptor, after addHello; 'C' dialler, after addClientAuth); all zeros
// without a secret. Fails only when libcrypto is unusable.
Result<Digest> handshakeProof(const std::string& secret, char role, const Transcript& t);
// An authenticated channel's session (after addVerdict): its key (transport/auth_stream.h) and the
// AuthResult's tag under it. Without a secret: no key, zero tag.
struct Session {
  std::shared_ptr<const crypto::Key> key;
  uint8_t verdict_tag[16] = {0};
  bool integrity = false;  // payload integrity was agreed (AuthResult flags)
};
Result<Session> deriveSession(const std::string& secret, const Transcript& t);
// kLinkFailed (kFeatureNotEnabled when libcrypto is missing) for a handshake that could not be
// computed.
Status sessionFailed(const Status& why);
// kLinkFailed naming both protocol versions and what to do.
Status versionMismatch(uint16_t peer_version);
// Where this process runs (a hint for same-host redirects, never a proof).
wire::HostHint localHint();
// Client half of one channel's handshake (handshake.cc).
Status helloExchange(Socket& s, wire::Hello hello, const std::string& secret, const wire::ClientAuth& mine,
                     uint64_t* peer_id, wire::AuthResult* result, Session* session, Deadline deadline);

}  // namespace pdlink::detail
