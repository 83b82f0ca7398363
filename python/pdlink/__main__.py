"""``python -m pdlink`` is the ``pdlink`` command."""
import sys

from .cli import main

sys.exit(main())
