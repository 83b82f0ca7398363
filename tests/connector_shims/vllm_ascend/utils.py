"""vllm_ascend.utils without torch_npu: the SoC query the connector makes (an A2: no super pods)."""

import enum


class AscendSocVersion(enum.Enum):
    A2 = 0
    A3 = 1
    UNDEFINED = 2


def get_ascend_soc_version() -> AscendSocVersion:
    return AscendSocVersion.A2
