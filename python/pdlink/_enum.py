"""``NamedIntEnum``: an IntEnum that prints as ``"Class.MEMBER"`` on every Python version.

Python 3.11 changed ``IntEnum.__str__``/``__format__`` to the integer forms; llm_datadist's
enums print ``"LLMStatusCode.LLM_SUCCESS"``, ``"LLMRole.PROMPT"``, ``"Placement.HOST"``.
"""

from enum import IntEnum


class NamedIntEnum(IntEnum):
    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    def __format__(self, format_spec: str) -> str:
        # [INF] A plain f"{member}" renders like str() (what 3.10 did with __str__ overridden);
        # a non-empty spec such as "d" or "#x" formats the integer.
        if not format_spec:
            return str(self)
        return int.__format__(int(self), format_spec)
