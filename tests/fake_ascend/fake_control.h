// Test-only control API of the fake Ascend libraries (tests/fake_ascend). Exported from the fake
// libascendcl.so; the real vendor library has none of these, so production code must never look
// them up. Tests reach them through ctypes (or dlsym) to inject faults and to check for leaks.
#pragma once

#include <cstddef>

extern "C" {

// From now on, calls of `fn` (its exact exported name, or a pseudo-name below) fail with `rc` after
// `after_n` calls that were let through, `times` times (times < 0: forever). rc must be non-zero
// (0 means "no failure"). Setting `fn` again replaces its injection; fn == NULL clears every
// injection. Returns 0.
//
// Pseudo-names (counted once per sent item, on the SENDING side of an HCCL transfer):
//   "hccl.remote_error"  send an error marker instead of the item: the receiver's task fails with
//                        HCCL_E_REMOTE, the sender's with `rc` (as an HcclResult).
//   "hccl.stall"         do not send the item: wait (at most HCCL_EXEC_TIMEOUT) until the peer
//                        gives up, so the receiver fails with HCCL_E_TIMEOUT (rc is not used
//                        beyond arming the injection).
// The same injections can be set before the libraries load with the environment variable
// FAKE_ASCEND_INJECT="fn:rc:after_n:times;fn2:rc:after_n:times", read on first use.
int fake_ascend_inject(const char* fn, int rc, int after_n, int times);

// How many times `fn` (exported name or pseudo-name) was called in this process.
long fake_ascend_calls(const char* fn);

// Bytes currently allocated with aclrtMalloc on `device` (0 for a device never used).
unsigned long long fake_acl_bytes_in_use(int device);

// Test-only direct access to device memory, bypassing aclrtMemcpy (and so pdlink's backend): copy
// `n` bytes between [device_addr, +n) and host memory. The range must lie inside one live
// allocation (or IPC import) of this process. Returns 0, or -1 (nothing copied) when it does not.
// Tests read expected bytes this way so that an offset bug in the backend's copies cannot cancel
// out between writing the test data and checking it.
int fake_acl_peek(const void* device_addr, void* host_dst, size_t n);
int fake_acl_poke(void* device_addr, const void* host_src, size_t n);

}  // extern "C"
