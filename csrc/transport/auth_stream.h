// AuthStream: an authenticated link's channel. Every frame carries a 16-byte tag, HMAC-SHA256 under
// the channel's session key (derived from the handshake, engine/handshake.cc, deriveSession) over
// the frame's direction, its sequence number and its bytes. Each side counts the frames it sends and
// receives on the channel and never sends a counter, so a frame injected, replayed, reordered,
// dropped or cut short fails the check, and the link is dropped. A transfer's payload (tensor
// bytes) is covered by a tag of its own only with payload integrity; without it, its length is
// still covered (it is in the frame before it), its bytes are not.
//
// A frame is what its sender sends between two sealFrame calls; the receiver reads it, then calls
// checkFrame before it acts on any of it. A failed check is logged and returned as kLinkFailed; the
// caller drops the link (a byte stream that lost one frame cannot be trusted with the next).
//
// Ownership: wraps a Stream it does not own (the Link owns both).
// Threading: like the Stream: one sender and one receiver at a time (the link serialises them).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/crypto.h"
#include "transport/stream.h"

namespace pdlink {

class AuthStream final : public Stream {
 public:
  static constexpr size_t kTagBytes = 16;

  // `requester`: this side sends requests on this channel (it uses the frame direction labels in
  // the order that makes both ends agree).
  AuthStream(Stream& inner, std::shared_ptr<const crypto::Key> key, bool requester, bool payload_integrity)
      : inner_(inner),
        key_(std::move(key)),
        send_dir_(requester ? 'Q' : 'A'),
        recv_dir_(requester ? 'A' : 'Q'),
        integrity_(payload_integrity) {}

  Status sendv(std::vector<iovec>& iov, Deadline deadline) override;
  Status recvv(std::vector<iovec>& iov, Deadline deadline) override;
  Status waitReadable(Deadline deadline) override { return inner_.waitReadable(deadline); }
  const std::string& peer() const override { return inner_.peer(); }

  // In payload mode without payload integrity, seal and check do nothing: such a payload has no tag.
  Status sendFrame(std::vector<iovec>& iov, Deadline deadline) override;
  Status sealFrame(Deadline deadline) override;
  Status checkFrame(Deadline deadline) override;
  // Called at frame boundaries only.
  void payload(bool on) override { in_payload_ = on; }
  bool authenticated() const override { return true; }
  bool payloadIntegrity() const override { return integrity_; }

 private:
  // The running MAC of the frame being sent (received), started on its first byte; nullptr once a
  // MAC could not be started.
  crypto::Key::Mac* mac(std::optional<crypto::Key::Mac>& m, char dir, uint64_t seq);
  // The tag of the frame being sent; the next frame starts.
  Result<Digest> finishSend();
  bool covered() const { return !in_payload_ || integrity_; }

  Stream& inner_;
  std::shared_ptr<const crypto::Key> key_;
  const char send_dir_, recv_dir_;
  const bool integrity_;
  bool in_payload_ = false;
  uint64_t send_seq_ = 0, recv_seq_ = 0;
  std::optional<crypto::Key::Mac> send_mac_, recv_mac_;
  Status broken_;  // a MAC could not be started (out of memory): every later frame fails
};

}  // namespace pdlink
