"""Errors of the Mooncake backend, and Mooncake's error codes mapped to the contract's statuses."""

from __future__ import annotations

from ascendstore.contract import BackendSetupError, Status
from ascendstore.errors import ConfigError


class MooncakeConfigError(ConfigError, BackendSetupError):
    """A Mooncake option is missing or wrong. Both a config error and a set-up error:
    callers catching either see it."""


#: Mooncake ErrorCode values (mooncake-store types.h) as seen from the Python client.
INTERNAL_ERROR = -1
BUFFER_OVERFLOW = -10
SHARD_INDEX_OUT_OF_RANGE = -100
SEGMENT_NOT_FOUND = -101
SEGMENT_ALREADY_EXISTS = -102
NO_AVAILABLE_HANDLE = -200
INVALID_VERSION = -300
INVALID_KEY = -400
WRITE_FAIL = -500
INVALID_PARAMS = -600
INVALID_WRITE = -700
INVALID_READ = -701
INVALID_REPLICA = -702
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901

_EXACT: dict[int, Status] = {
    0: Status.OK,
    NO_AVAILABLE_HANDLE: Status.NO_SPACE,  # pool full (eviction runs asynchronously)
    INVALID_KEY: Status.INVALID,
    INVALID_PARAMS: Status.INVALID,  # empty key, zero size, buffer smaller than the object
    BUFFER_OVERFLOW: Status.INVALID,
    SHARD_INDEX_OUT_OF_RANGE: Status.INVALID,
    OBJECT_NOT_FOUND: Status.NOT_FOUND,
    REPLICA_IS_NOT_READY: Status.NOT_FOUND,  # a put still in flight: not readable yet
    OBJECT_ALREADY_EXISTS: Status.OK,  # the first value stays (capabilities.overwrite_on_put=False)
    OBJECT_HAS_LEASE: Status.UNAVAILABLE,  # busy: a reader holds a lease
    TRANSFER_FAIL: Status.UNAVAILABLE,
    RPC_FAIL: Status.UNAVAILABLE,  # master unreachable
    RPC_TIMEOUT: Status.TIMEOUT,
}


def status_of(code: int) -> Status:
    """Contract status of one Mooncake return code (>= 0 is success: some calls return byte counts)."""
    if code >= 0:
        return Status.OK
    # Everything else (internal, segment, etcd/HA, file/SSD, lease expiry, replica states)
    # is a service-side condition a caller can only retry later or recompute.
    return _EXACT.get(code, Status.UNAVAILABLE)
