"""vllm.forward_context: the type the connector's start_load_kv takes (and ignores)."""


class ForwardContext:
    pass
