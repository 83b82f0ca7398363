"""pdlink's implementation of CANN's ``hixl`` module (docs/hixl.md), imported as ``hixl``.

Engines listen or dial by ``"ip:port"``, register memory by address and length, and move lists of
(local address, remote address, length) descriptors, sync or async, over pdlink's links; they
also carry small notifications. Every runtime outcome is an integer status code.
"""

from .hixl import Hixl, get_capability
from .types import (
    ALREADY_CONNECTED,
    AUTO_CONNECT,
    CLIENT_SERVER_COMM,
    CONNECT_FAILED,
    CONNECT_PENDING,
    CONNECTED,
    CONNECTING,
    DISCONNECT_PENDING,
    DISCONNECTING,
    FAILED,
    FEATURE_NOT_SUPPORTED,
    FEATURE_SUPPORTED,
    MEM_DEVICE,
    MEM_HOST,
    NOT_CONNECT,
    NOT_CONNECTED,
    NOTIFY_FAILED,
    OPTION_AUTO_CONNECT,
    OPTION_BUFFER_POOL,
    OPTION_ENABLE_USE_FABRIC_MEM,
    OPTION_GLOBAL_RESOURCE_CONFIG,
    OPTION_LOCAL_COMM_RES,
    OPTION_RDMA_SERVICE_LEVEL,
    OPTION_RDMA_TRAFFIC_CLASS,
    PARAM_INVALID,
    READ,
    RESOURCE_EXHAUSTED,
    SUCCESS,
    TIMEOUT,
    UNSUPPORTED,
    WRITE,
    AsyncConnectStatus,
    FeatureType,
    GetTransferStatusArgs,
    MemDesc,
    MemType,
    NotifyDesc,
    TransferArgs,
    TransferOp,
    TransferOpDesc,
    TransferResult,
    TransferStatus,
)

# CANN's hixl.__all__, in its order (hixl_api.md §2).
__all__ = [
    "SUCCESS", "PARAM_INVALID", "TIMEOUT", "NOT_CONNECTED", "ALREADY_CONNECTED", "NOTIFY_FAILED", "UNSUPPORTED",
    "FAILED", "RESOURCE_EXHAUSTED",
    "OPTION_ENABLE_USE_FABRIC_MEM", "OPTION_RDMA_TRAFFIC_CLASS", "OPTION_RDMA_SERVICE_LEVEL", "OPTION_BUFFER_POOL",
    "OPTION_GLOBAL_RESOURCE_CONFIG", "OPTION_AUTO_CONNECT", "OPTION_LOCAL_COMM_RES",
    "FEATURE_SUPPORTED", "FEATURE_NOT_SUPPORTED",
    "MemType", "MEM_DEVICE", "MEM_HOST", "TransferOp", "READ", "WRITE", "TransferStatus", "AsyncConnectStatus",
    "NOT_CONNECT", "CONNECT_PENDING", "CONNECTING", "CONNECTED", "CONNECT_FAILED", "DISCONNECT_PENDING",
    "DISCONNECTING", "FeatureType", "AUTO_CONNECT", "CLIENT_SERVER_COMM",
    "MemDesc", "TransferOpDesc", "TransferArgs", "GetTransferStatusArgs", "TransferResult", "NotifyDesc", "Hixl",
    "get_capability",
]
