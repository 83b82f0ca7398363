"""UCX worker addresses for the tests of pdlink's check of them (ucx::checkWorkerAddress,
csrc/transport/ucx/ucx_worker.h): one as UCX 1.22 makes it, and forms of it UCX would misread."""

from __future__ import annotations

# A network worker's address (UCX's v1 layout: tcp on a TEST-NET address and on lo), as made here;
# the same bytes seed the fuzz target (csrc/fuzz/make_seeds.cc).
REAL_ADDRESS = bytes.fromhex(
    "208cbb089ec7c42fe400060002c0000202cf1917b751389763344bd7e037370013230082e13d000e0102ac88c7aa08e6"
    "52a6f9ffffefcf1917b75138539e3e4bd7e037370113230082b5638680")

# Each refused before UCX sees it; by name, what UCX would do with it.
MISREAD = {
    "version_5": b"\xa5" * 64,  # what aborted the victim: UCX asserts on an unknown address version
    "version_3": bytes([REAL_ADDRESS[0] & 0xF0 | 2]) + REAL_ADDRESS[1:],
    "one_byte_short": REAL_ADDRESS[:-1],  # UCX would read past its end
    "one_byte_more": REAL_ADDRESS + b"\0",
    "no_device_address_for_tcp": REAL_ADDRESS[:9] + b"\x00\x00" + REAL_ADDRESS[17:],  # a null pointer to tcp
    "endpoint_addresses": REAL_ADDRESS[:35] + bytes([REAL_ADDRESS[35] | 0x40]) + REAL_ADDRESS[36:],
}
