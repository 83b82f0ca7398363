"""vllm's KV connector base classes: the metadata binding a worker's connector relies on."""

from __future__ import annotations

import enum
from typing import Any


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorMetadata:
    """What the scheduler hands each worker's connector per step."""


class KVConnectorBase_V1:  # noqa: N801 - vLLM's name
    _connector_metadata: Any = None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._connector_metadata = None
