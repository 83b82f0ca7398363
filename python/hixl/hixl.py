"""``hixl.hixl``: CANN's compiled submodule, which its package re-exports; the same names here."""

from pdlink.compat.hixl import *  # noqa: F403
from pdlink.compat.hixl import __all__  # noqa: F401
