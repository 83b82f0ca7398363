"""What a test's peers run on: the ``transport`` fixture's values and the environment each gives.

Every data-movement test runs three times:

* ``cma``: CPU backend, direct memory access between the two processes (process_vm_readv);
* ``tcp``: CPU backend, loopback TCP;
* ``ascend``: the Ascend backend on the fake vendor libraries (tests/fake_ascend), built once per
  test session. DEVICE bytes move over HCCL (the fake's local sockets); the link's control
  connection (and HOST caches) use TCP.

``peer_env(transport)`` is the environment for a peer process of that kind; tests that start
peers themselves pass it (``peers("prefill", env=peer_env(transport))``). Tests of one engine (or
of links that do not depend on the CPU transport) use the ``backend`` fixture instead: ``cpu``
(PDLINK_TRANSPORT left at auto) or ``ascend``; ``peer_env`` takes those names too.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from typing import Dict

TRANSPORTS = ("cma", "tcp", "ascend")
BACKENDS = ("cpu", "ascend")

# The fake HCCL waits 120 s by default, like the real one; tests want failures in seconds.
# HCCL_CONNECT_TIMEOUT bounds communicator setup (a peer that never joins), HCCL_EXEC_TIMEOUT a
# transfer the peer never completes (on the side that is not bounded by sync_kv_timeout).
HCCL_TIMEOUTS = {"HCCL_CONNECT_TIMEOUT": "10", "HCCL_EXEC_TIMEOUT": "5"}

_HERE = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def fake_ascend_dir() -> str:
    """The directory holding the fake libascendcl.so and libhccl.so (built on first use, cached
    under build/fake-ascend/). Raises if the build fails."""
    spec = importlib.util.spec_from_file_location("_fake_ascend_build", _HERE / "fake_ascend" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.build("full"))


def peer_env(transport: str, **extra: str) -> Dict[str, str]:
    """Environment variables for a peer process running as `transport` (plus `extra`)."""
    if transport == "ascend":
        env = {"PDLINK_BACKEND": "ascend", "PDLINK_ASCEND_LIB_DIR": fake_ascend_dir(), "PDLINK_TRANSPORT": "tcp",
               **HCCL_TIMEOUTS}
    elif transport in ("cma", "tcp"):
        env = {"PDLINK_BACKEND": "cpu", "PDLINK_TRANSPORT": transport}
    elif transport == "cpu":
        env = {"PDLINK_BACKEND": "cpu"}
    else:
        raise ValueError(f"unknown transport {transport!r}; one of {TRANSPORTS + BACKENDS}")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def link_transport(transport: str) -> str:
    """The transport ``dd.links()`` reports for a link between two peers of that kind."""
    return "tcp" if transport == "ascend" else transport


def backend_name(transport: str) -> str:
    """The backend (``dd._engine.backend``) of a peer of that kind."""
    return "ascend" if transport == "ascend" else "cpu"
