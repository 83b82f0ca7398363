"""``from pdlink.compat.llm_datadist.data_type import *`` (only allowed at module level): what
``fresh_import.light_modules_import_numpy`` imports to check that a star-import of data_type does
not import numpy."""

from pdlink.compat.llm_datadist.data_type import *  # noqa: F403
