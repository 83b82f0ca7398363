"""The REST role table (``pdlink.server.roles``): MindIE's three roles, each an engine role the
native module has, and the one list the validator, the client and the CLI accept."""

from __future__ import annotations

import pytest

from internals import ROLES as VALIDATION_ROLES
from internals import core
from pdlink import cli, client
from pdlink.server.roles import ROLE_NAMES, ROLES


def test_mindies_roles_and_their_engine_roles():
    assert ROLE_NAMES == ("prefill", "decode", "flex")  # MindIE's route: /v1/role/(prefill|decode|flex)
    assert {n: (r.engine_role, r.listens, r.takes_p_percentage) for n, r in ROLES.items()} == {
        "prefill": ("PROMPT", True, False), "decode": ("DECODER", False, False), "flex": ("MIX", True, True)}
    assert all(r.engine_role in core.Role.__members__ for r in ROLES.values())


def test_every_reader_takes_the_tables_roles():
    assert VALIDATION_ROLES is ROLES and client.ROLES == ROLE_NAMES
    for name in ROLE_NAMES:
        with pytest.raises(SystemExit) as ok:  # accepted, then --help exits 0
            cli.main(["role", name, "--help"])
        assert ok.value.code == 0
    with pytest.raises(SystemExit) as e:
        cli.main(["role", "mix", "--help"])
    assert e.value.code == 2  # argparse: an invalid choice
