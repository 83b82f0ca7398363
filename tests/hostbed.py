"""The emulated hosts of pdlink.testing.hosts in tests: ``require_hosts()`` skips a test that needs
them with the reason they cannot be made here, or fails it when PDLINK_REQUIRE_HOSTS=1 (CI sets
it, so a machine that lost the ability never passes by skipping)."""

from __future__ import annotations

import os

import pytest

from pdlink.testing.hosts import unavailable_reason


def require_hosts() -> None:
    """Skip (or, under PDLINK_REQUIRE_HOSTS=1, fail) when hosts cannot be made here."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("PDLINK_REQUIRE_HOSTS") == "1":
        pytest.fail(f"PDLINK_REQUIRE_HOSTS=1 but hosts cannot be made: {reason}", pytrace=False)
    pytest.skip(f"needs emulated hosts: {reason}")
