"""The roles of ``POST /v1/role/{role}``: one table that the routes, the validator, the node, the
client and the CLI read (stdlib only, so the client stays light).

| REST name (MindIE's) | engine role (``_core.Role``, ``LLMRole``) | engines listen | ``p_percentage`` |
| --- | --- | --- | --- |
| ``prefill`` | ``PROMPT`` | yes | no |
| ``decode`` | ``DECODER`` | no (they dial) | no |
| ``flex`` | ``MIX`` | yes | yes (a first assignment may then have no peers) |
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RestRole", "PREFILL", "DECODE", "FLEX", "ROLES", "ROLE_NAMES"]


@dataclass(frozen=True)
class RestRole:
    """One role of the REST API."""

    name: str  # the URL's and ``currentRole``'s name, as MindIE spells it
    engine_role: str  # the name of the engine role its engines run as
    listens: bool  # its engines listen for peers' links (else they dial)
    takes_p_percentage: bool  # its body may carry ``local.p_percentage`` (the prefill share)


PREFILL = RestRole("prefill", "PROMPT", listens=True, takes_p_percentage=False)
DECODE = RestRole("decode", "DECODER", listens=False, takes_p_percentage=False)
FLEX = RestRole("flex", "MIX", listens=True, takes_p_percentage=True)

ROLES: dict[str, RestRole] = {r.name: r for r in (PREFILL, DECODE, FLEX)}
"""Every REST role by name, in the order of the API's docs."""

ROLE_NAMES: tuple[str, ...] = tuple(ROLES)
