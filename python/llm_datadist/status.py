"""``llm_datadist.status`` (re-exported from pdlink.status)."""
from pdlink.status import *  # noqa: F401,F403
from pdlink.status import LLMException, LLMStatusCode, Status, code_2_status, handle_llm_status  # noqa: F401
from pdlink.status import raise_if_false, raise_if_true  # noqa: F401
