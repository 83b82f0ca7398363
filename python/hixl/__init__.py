"""Drop-in ``hixl`` package backed by pdlink.

Code written for CANN's ``hixl`` module imports this unchanged::

    import hixl
    engine = hixl.Hixl()
    engine.initialize("127.0.0.1:16000", {hixl.OPTION_AUTO_CONNECT: "1"})

Where CANN is installed, its own ``hixl`` comes first on ``sys.path`` and wins (docs/hixl.md,
"Which hixl is imported"). Everything here is re-exported from ``pdlink.compat.hixl``.
"""

from pdlink.compat.hixl import *  # noqa: F403
from pdlink.compat.hixl import __all__  # noqa: F401
