"""``llm_datadist.status`` (re-exported from pdlink.status)."""
from pdlink.status import *  # noqa: F401,F403
from pdlink.status import (  # noqa: F401  # noqa: F401
    LLMException,
    LLMStatusCode,
    Status,
    code_2_status,
    handle_llm_status,
    raise_if_false,
    raise_if_true,
)
