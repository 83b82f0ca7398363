"""Where things are: the tests folder and the repository root, for tests in any sub-folder."""

from __future__ import annotations

import pathlib

TESTS = pathlib.Path(__file__).resolve().parent
REPO = TESTS.parent
