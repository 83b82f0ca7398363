"""vllm.v1.core.sched.output: the scheduler's step output (opaque to the connector)."""


class SchedulerOutput:
    pass
