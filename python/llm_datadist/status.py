"""``llm_datadist.status`` (re-exported from pdlink.status; llm_datadist's message helper
``handle_llm_status`` from pdlink.compat.llm_datadist)."""
from pdlink.compat.llm_datadist._utils import handle_llm_status  # noqa: F401
from pdlink.status import *  # noqa: F401,F403
from pdlink.status import (  # noqa: F401
    LLMException,
    LLMStatusCode,
    Status,
    code_2_status,
    raise_if_false,
    raise_if_true,
)
