#include "transport/auth_stream.h"

#include "core/log.h"

namespace pdlink {

crypto::Key::Mac* AuthStream::mac(std::optional<crypto::Key::Mac>& m, char dir, uint64_t seq) {
  if (!m && broken_.ok()) {
    auto started = key_->start();
    if (!started.ok()) {
      broken_ = started.status();  // every later seal and check fails: the link is dropped
      return nullptr;
    }
    m.emplace(std::move(started.value()));
    m->update(&dir, 1);
    m->update(&seq, sizeof(seq));
  }
  return m ? &*m : nullptr;
}

Status AuthStream::sendv(std::vector<iovec>& iov, Deadline deadline) {
  if (covered()) {
    if (crypto::Key::Mac* m = mac(send_mac_, send_dir_, send_seq_)) {
      for (const iovec& v : iov) m->update(v.iov_base, v.iov_len);  // before sendv consumes the list
    }
  }
  return inner_.sendv(iov, deadline);
}

Status AuthStream::recvv(std::vector<iovec>& iov, Deadline deadline) {
  if (!covered()) return inner_.recvv(iov, deadline);
  const std::vector<iovec> original = iov;  // recvv consumes the list as bytes arrive
  PDLINK_RETURN_IF_ERROR(inner_.recvv(iov, deadline));
  if (crypto::Key::Mac* m = mac(recv_mac_, recv_dir_, recv_seq_)) {
    for (const iovec& v : original) m->update(v.iov_base, v.iov_len);
  }
  return Status::OK();
}

Result<Digest> AuthStream::finishSend() {
  crypto::Key::Mac* m = mac(send_mac_, send_dir_, send_seq_);
  if (!m) return broken_;
  Digest tag = m->finish();
  send_mac_.reset();
  ++send_seq_;
  return tag;
}

Status AuthStream::sendFrame(std::vector<iovec>& iov, Deadline deadline) {
  if (!covered()) return inner_.sendv(iov, deadline);
  if (crypto::Key::Mac* m = mac(send_mac_, send_dir_, send_seq_)) {
    for (const iovec& v : iov) m->update(v.iov_base, v.iov_len);
  }
  auto tag = finishSend();
  if (!tag.ok()) return tag.status();
  iov.push_back({tag.value().data(), kTagBytes});  // one write for the frame and its tag
  return inner_.sendv(iov, deadline);
}

Status AuthStream::sealFrame(Deadline deadline) {
  if (!covered()) return Status::OK();
  auto tag = finishSend();
  if (!tag.ok()) return tag.status();
  return inner_.sendAll(tag.value().data(), kTagBytes, deadline);
}

Status AuthStream::checkFrame(Deadline deadline) {
  if (!covered()) return Status::OK();
  crypto::Key::Mac* m = mac(recv_mac_, recv_dir_, recv_seq_);
  if (!m) return broken_;
  Digest expected = m->finish();
  recv_mac_.reset();
  ++recv_seq_;
  uint8_t tag[kTagBytes];
  PDLINK_RETURN_IF_ERROR(inner_.recvAll(tag, sizeof(tag), deadline));
  if (!constantTimeEqual(tag, expected.data(), kTagBytes)) {
    Status bad(Code::kLinkFailed, "frame " + std::to_string(recv_seq_ - 1) + " from " + inner_.peer() +
                                      " failed its authentication (injected, replayed, reordered, altered or cut "
                                      "short on the way)");
    PDLINK_LOG(kWarn, bad.message() << "; dropping the link");
    return bad;
  }
  return Status::OK();
}

}  // namespace pdlink
