"""A cluster controller in a process of its own: it posts role switches to a ``pdlink serve`` over
plain HTTP (loopback) and reads its role document. The epoch tests kill it mid-switch."""

from __future__ import annotations

from typing import Any

from pdlink.client import ManagementClient


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body`` to ``path``: (status, decoded JSON answer)."""
    response = ManagementClient("127.0.0.1", port, https=False, retries=0).request("POST", path, body)
    return response.status, response.json()


def pd_role(port: int) -> Any:
    """``GET /v1/pd_role``'s document."""
    return ManagementClient("127.0.0.1", port, https=False, retries=0).get_json("/v1/pd_role")
