"""vllm.utils: the connector's logger and this host's address (loopback: tests never leave it)."""

import logging

logger = logging.getLogger("vllm")


def get_ip() -> str:
    return "127.0.0.1"
