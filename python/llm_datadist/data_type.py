"""``llm_datadist.data_type`` (re-exported from pdlink.compat.llm_datadist.data_type; numpy maps load lazily)."""
from pdlink.compat.llm_datadist import data_type as _dt
from pdlink.compat.llm_datadist.data_type import DataType  # noqa: F401


def __getattr__(name):
    return getattr(_dt, name)
