"""Code that runs inside peer processes (tests/peer.py ``Peer.call``): importable, linted and typed
like every other test module. Each module keeps its per-process state in its own globals."""
