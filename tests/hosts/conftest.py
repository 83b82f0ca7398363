"""Fixtures for the emulated hosts (pdlink.testing.hosts); ``hostbed.require_hosts`` skips or fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hostbed import require_hosts
from pdlink.testing.hosts import Hosts


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[Hosts]:
    """Two hosts on a plain (unshaped) wire, shared by the tests of one module that change nothing."""
    require_hosts()
    with Hosts(2) as hosts:
        yield hosts
