// The device paths over a link's device channels (Backend::DeviceChannel; on Ascend, HCCL).
// DEVICE memory of a device backend never travels in a link's stream: the request and the answer
// do, the bytes go over the link's device channel of their direction (transport/device/
// device_channel.h: device::outChannel for this side's requests, device::inChannel for the peer's),
// which each path's connect() sets up on first use.
//  - HcclPath: two-sided (HcclBatchSendRecv): after the peer accepted the request, both sides
//    post their half; works for any DEVICE memory.
//  - OneSidedPath: one-sided (HcclBatchGet/Put): the peer answers with the addresses of the
//    checked ranges, inside memory both channels prepared; only this side moves the bytes.
#pragma once

#include "transport/path.h"
#include "transport/path_table.h"

namespace pdlink {

class HcclPath : public DataPath {
 public:
  HcclPath();
  const PathCaps& caps() const override { return caps_; }
  // The link's device channel for this side's requests (device::ensureOutChannel).
  Status connect(Link& link, const PathEnv& env, Deadline deadline, const char* what) override;
  bool usable(const Link& link) const override;
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  PathCaps caps_;
};

class HcclServer : public PathServer {
 public:
  Status serve(ServeCall& call) override;
};

class OneSidedPath : public DataPath {
 public:
  OneSidedPath();
  const PathCaps& caps() const override { return caps_; }
  Status connect(Link& link, const PathEnv& env, Deadline deadline, const char* what) override;
  // A channel whose runtime has one-sided access (memory registered after the link may still not
  // be prepared: then transfer() is kFeatureNotEnabled and the two-sided path takes it).
  bool usable(const Link& link) const override;
  Status transfer(Link& link, TransferPlan& p, bool is_push, Deadline deadline, const char* what) override;

 private:
  PathCaps caps_;
};

class OneSidedServer : public PathServer {
 public:
  Status serve(ServeCall& call) override;
};

// HCCL's table entries. Two-sided: applies to every link of a device backend, served there.
// One-sided: applies where the configuration enables it and the runtime has it, served where the
// runtime has it.
PathEntry hcclEntry(const BackendOffer& offer);
PathEntry oneSidedEntry(const BackendOffer& offer);

}  // namespace pdlink
