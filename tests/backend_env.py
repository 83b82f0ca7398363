"""The fixture matrix: which backend and data path a test's peers run on, and the environment each
gives a peer process.

Every data-movement test runs once per ``Variant`` (the ``variant`` fixture, conftest.py):

* ``cpu-cma``: CPU backend, direct memory access between the two processes (process_vm_readv);
* ``cpu-tcp``: CPU backend, loopback TCP;
* ``ascend-fake``: the Ascend backend on the fake vendor libraries (tests/fake_ascend), built once
  per test session. DEVICE bytes move over HCCL (the fake's local sockets); the link's control
  connection (and HOST caches) use TCP;
* ``ascend-ipc``: the same backend on a same-host link: DEVICE bytes move by IPC (the requester
  maps the server's exported memory), HOST bytes by cma;
* ``ascend-onesided``: the same backend with one-sided HCCL (``PDLINK_HCCL_ONE_SIDED=1`` on both
  sides): DEVICE bytes move by HcclBatchGet/Put into memory the server prepared, over TCP.

* ``cpu-ucx``, ``cpu-ucx-sm``: CPU backend, host memory moved as UCX Active Messages
  (``PDLINK_TRANSPORT=ucx``) over UCX's tcp transport, and over shared memory beside it
  (``UCX_TLS=sm,tcp``; the links are proven same-host links), with ``PDLINK_UCX_TRUSTED_NETWORK=1``
  (loopback only). They need UCX (``pdlink[ucx]``): without
  it they skip, except under ``PDLINK_REQUIRE_UCX=1`` (.ci/ucx.sh), where that is a failure.
* ``cpu-tcp-hosts``, ``cpu-ucx-hosts``: the two-hosts cells. Every peer of a test runs on an emulated
  host of its own (``pdlink.testing.hosts``: network, pid and mount namespaces joined by a plain
  switch; ``Variant.hosts``), so a prefill and a decoder are two hosts and their links cross a real
  network interface: tcp with the transport left at ``auto`` (which must never choose cma or a
  same-host stream across hosts), and UCX over its tcp transport with ``PDLINK_UCX_TRUSTED_NETWORK=1``.
  Without the privileges to make hosts they skip with the reason, except under
  ``PDLINK_REQUIRE_HOSTS=1`` (CI), where that is a failure.
The ascend-ipc and ascend-onesided cells are ``heavy``: the default run puts them through their own files, the heavy run
through the whole shared suite as well. A new data path is one more ``Variant`` here (and nothing
else in the tests). ``peer_env`` is the
environment for a peer process of a variant (or of a legacy transport name: "cma", "tcp",
"ascend"; or of a backend: "cpu", "ascend"). Tests of one engine, or of links that do not depend on
the CPU data path, use the ``backend`` fixture: ``cpu`` (PDLINK_TRANSPORT left at auto) or
``ascend``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib

_HERE = pathlib.Path(__file__).resolve().parent

# The fake HCCL waits 120 s by default, like the real one; tests want failures in seconds.
# HCCL_CONNECT_TIMEOUT bounds communicator setup (a peer that never joins), HCCL_EXEC_TIMEOUT a
# transfer the peer never completes (on the side that is not bounded by sync_kv_timeout).
HCCL_TIMEOUTS = {"HCCL_CONNECT_TIMEOUT": "10", "HCCL_EXEC_TIMEOUT": "5"}


@functools.cache
def fake_ascend_dir() -> str:
    """The directory holding the fake libascendcl.so and libhccl.so (built on first use, cached
    under build/fake-ascend/). Raises if the build fails."""
    spec = importlib.util.spec_from_file_location("_fake_ascend_build", _HERE / "fake_ascend" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build("full"))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One cell of the matrix.

    ``id``: the test id; ``backend``: the engine's backend; ``link_transport``: what ``links()``
    reports as ``transport`` (the path of HOST memory; "cma": a proven same-host link, see
    ``same_host``); ``kind``: the short name ``peer_env`` takes ("cma", "tcp", "ascend",
    "ascend-ipc", "ascend-onesided"); ``serving_loop``: every transfer goes through the peer's
    serving thread, so a frozen peer makes a pull time out (false for cma, where a cached-layout
    read is a kernel copy that needs nothing from the peer); ``extra_env``: what else its peers set;
    ``heavy``: the shared suite runs on it with the heavy tests only (``pytest -m heavy``), to keep
    the default run in its budget; its own test file (paths/test_ascend_ipc.py, paths/test_ascend_onesided.py)
    runs by default."""

    id: str
    backend: str
    link_transport: str
    kind: str
    serving_loop: bool
    extra_env: tuple[tuple[str, str], ...] = ()
    heavy: bool = False
    needs_ucx: bool = False
    hosts: bool = False  # each peer on an emulated host of its own (conftest's ``peers`` places them)

    @property
    def same_host(self) -> bool:
        """Its links are proven same-host links (AF_UNIX channels a raw attacker reaches through
        the acceptor's redirect; direct or IPC access)."""
        return self.link_transport == "cma"

    def host_transport(self, env: dict[str, str]) -> str:
        """What ``links()`` reports as ``transport`` on a peer of this variant with environment
        ``env``: ``link_transport``, except that a ucx engine keeps links with payload integrity on
        the stream (which seals the bytes): "unix" on one host, "tcp" between two."""
        if self.link_transport == "ucx" and env.get("PDLINK_PAYLOAD_INTEGRITY") == "1":
            return "tcp" if self.hosts else "unix"
        return self.link_transport

    def device_paths(self, env: dict[str, str]) -> tuple[str, ...]:
        """What ``links()`` reports as ``device_paths`` on a peer of this variant with environment
        ``env`` (the engine tries them in this order): on the Ascend backend, IPC on a same-host
        link, one-sided HCCL where this peer enables it, then two-sided HCCL; nothing on CPU."""
        if self.backend != "ascend":
            return ()
        ipc = ("ipc",) if env.get("PDLINK_TRANSPORT", self.link_transport) == "cma" else ()
        one_sided = ("hccl-one-sided",) if env.get("PDLINK_HCCL_ONE_SIDED") == "1" else ()
        return (*ipc, *one_sided, "hccl")

    def env(self, **extra: str) -> dict[str, str]:
        if self.backend == "ascend":
            env = {"PDLINK_BACKEND": "ascend", "PDLINK_ASCEND_LIB_DIR": fake_ascend_dir(),
                   "PDLINK_TRANSPORT": self.link_transport, **HCCL_TIMEOUTS, **dict(self.extra_env)}
        else:
            env = {"PDLINK_BACKEND": "cpu", "PDLINK_TRANSPORT": self.link_transport, **dict(self.extra_env)}
        env.update({k: str(v) for k, v in extra.items()})
        return env

    @property
    def device_memory(self) -> bool:
        """DEVICE caches are device memory the host cannot touch."""
        return self.backend == "ascend"


VARIANTS = (
    Variant("cpu-cma", "cpu", "cma", "cma", serving_loop=False),
    Variant("cpu-tcp", "cpu", "tcp", "tcp", serving_loop=True),
    Variant("ascend-fake", "ascend", "tcp", "ascend", serving_loop=True),
    Variant("ascend-ipc", "ascend", "cma", "ascend-ipc", serving_loop=True, heavy=True),
    Variant("ascend-onesided", "ascend", "tcp", "ascend-onesided", serving_loop=True,
            extra_env=(("PDLINK_HCCL_ONE_SIDED", "1"),), heavy=True),
    Variant("cpu-ucx", "cpu", "ucx", "ucx", serving_loop=True, needs_ucx=True,
            extra_env=(("UCX_TLS", "tcp"), ("PDLINK_UCX_TRUSTED_NETWORK", "1"))),
    Variant("cpu-ucx-sm", "cpu", "ucx", "ucx-sm", serving_loop=True, needs_ucx=True,
            extra_env=(("UCX_TLS", "sm,tcp"), ("PDLINK_UCX_TRUSTED_NETWORK", "1"))),
    Variant("cpu-tcp-hosts", "cpu", "tcp", "tcp-hosts", serving_loop=True, hosts=True,
            extra_env=(("PDLINK_TRANSPORT", "auto"),)),
    Variant("cpu-ucx-hosts", "cpu", "ucx", "ucx-hosts", serving_loop=True, needs_ucx=True, hosts=True,
            extra_env=(("UCX_TLS", "tcp"), ("PDLINK_UCX_TRUSTED_NETWORK", "1"))),
)
BY_KIND = {v.kind: v for v in VARIANTS}
BACKENDS = ("cpu", "ascend")


def peer_env(kind: Variant | str, **extra: str) -> dict[str, str]:
    """Environment variables for a peer process of that kind (plus ``extra``)."""
    if isinstance(kind, Variant):
        return kind.env(**extra)
    if kind in BY_KIND:
        return BY_KIND[kind].env(**extra)
    if kind == "cpu":
        return {"PDLINK_BACKEND": "cpu", **{k: str(v) for k, v in extra.items()}}
    raise ValueError(f"unknown kind {kind!r}; one of {tuple(BY_KIND) + BACKENDS}")
