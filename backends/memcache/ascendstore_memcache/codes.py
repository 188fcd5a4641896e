"""MemCache return codes and their translation to contract statuses.

The numbers are MemCache's ``MmcErrorCode`` (``src/memcache/csrc/common/mmc_types.h``
of Ascend/memcache); the comments say which ones were *measured* against
memcache-hybrid 1.3.0 on this project's CPU machine (meta service on loopback,
pure client) and from which call.
"""

from __future__ import annotations

import enum

from ascendstore.contract import Status


class Mmc(enum.IntEnum):
    OK = 0
    #: generic failure. Measured: put/put_batch/batch_put_from_layers when the
    #: client has no memory to allocate from ("alloc ... failed, error code -1");
    #: get_into of a missing key; init() without a meta service or without a driver.
    ERROR = -1
    #: measured: bad copy direction, batch/size lists of different lengths, key
    #: longer than 256 bytes (the whole batch), null buffer, write_finish of a key
    #: this client did not allocate, batch_copy to GVA 0.
    INVALID_PARAM = -3000
    MALLOC_FAILED = -3001
    NEW_OBJECT_FAILED = -3002
    NOT_STARTED = -3003
    TIMEOUT = -3004
    REPEAT_CALL = -3005
    #: the pybind layer turns a duplicate put into 0 ("put operation skipped").
    DUPLICATED_OBJECT = -3006
    #: measured: batch_get_into_layers of a missing key.
    OBJECT_NOT_EXISTS = -3007
    NOT_INITIALIZED = -3008
    EXCEED_CAPACITY = -3013
    #: measured: every call after the meta service died (SIGKILL), immediately.
    LINK_NOT_FOUND = -3014
    NOT_ENOUGH_MEMORY = -3016
    NOT_CONNECT_META = -3017
    NOT_CONNECT_LOCAL = -3018
    #: measured: every call on a client whose init() failed or never ran.
    CLIENT_NOT_INIT = -3019
    SSD_NOT_AVAILABLE = -3020
    UNMATCHED_STATE = -3101
    #: measured: remove/remove_batch/batch_add_lease of a missing key.
    UNMATCHED_KEY = -3102
    UNMATCHED_RET = -3103
    LEASE_NOT_EXPIRED = -3104
    META_BACKUP_ERROR = -3105
    #: measured: batch_remove_lease without a lease held.
    LEASE_EXPIRED = -3106
    GVA_RANGE_ALREADY_WRITTEN = -3107
    WRITE_READABLE_BLOB = -3108


#: the pybind layer's limits (pymmc.cpp): more keys per batch, more layers per
#: key, or a longer key make the whole batch fail with INVALID_PARAM.
MAX_BATCH_KEYS = 512
MAX_LAYERS = 255
MAX_KEY_BYTES = 256

#: MediaType of batch_alloc/evict/prefetch (mmc_types.h): HBM=0, DRAM=1, SSD=2.
MEDIA_HBM, MEDIA_DRAM, MEDIA_SSD = 0, 1, 2

_UNAVAILABLE = {
    Mmc.NOT_STARTED,
    Mmc.NOT_INITIALIZED,
    Mmc.LINK_NOT_FOUND,
    Mmc.NOT_CONNECT_META,
    Mmc.NOT_CONNECT_LOCAL,
    Mmc.CLIENT_NOT_INIT,
    Mmc.SSD_NOT_AVAILABLE,
    Mmc.META_BACKUP_ERROR,
    Mmc.LEASE_NOT_EXPIRED,  # remove of an object a reader still holds: busy, retry later
}
_NOT_FOUND = {Mmc.UNMATCHED_KEY, Mmc.OBJECT_NOT_EXISTS, Mmc.LEASE_EXPIRED}
_NO_SPACE = {Mmc.EXCEED_CAPACITY, Mmc.NOT_ENOUGH_MEMORY, Mmc.MALLOC_FAILED}
_INVALID = {
    Mmc.INVALID_PARAM,
    Mmc.UNMATCHED_STATE,
    Mmc.UNMATCHED_RET,
    Mmc.GVA_RANGE_ALREADY_WRITTEN,
    Mmc.WRITE_READABLE_BLOB,
    Mmc.REPEAT_CALL,
}


def to_status(code: int, op: str) -> Status:
    """Status for one native result code of operation ``op``
    (``put`` | ``get`` | ``remove`` | ``exists`` | ``gva``)."""
    if code == Mmc.OK:
        return Status.OK
    if code == Mmc.DUPLICATED_OBJECT and op == "put":
        return Status.OK  # first value stays, as the pybind layer itself reports
    if code == Mmc.ERROR:
        # -1 from a put is the allocation failing (measured); elsewhere it is
        # an unspecified failure of the store.
        return Status.NO_SPACE if op == "put" else Status.UNAVAILABLE
    if code == Mmc.TIMEOUT:
        return Status.TIMEOUT
    if code in _NOT_FOUND:
        return Status.NOT_FOUND
    if code in _NO_SPACE:
        return Status.NO_SPACE
    if code in _INVALID:
        return Status.INVALID
    return Status.UNAVAILABLE


def exist_status(code: int) -> Status:
    """batch_is_exist answers 1 (present), 0 (absent) or a negative error code."""
    if code == 1:
        return Status.OK
    if code == 0:
        return Status.NOT_FOUND
    return to_status(code, "exists")


def describe(code: int) -> str:
    try:
        return f"{Mmc(code).name}({code})"
    except ValueError:
        return f"code {code}"
