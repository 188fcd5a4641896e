"""Pool keys: one model's (or layout's, or tenant's) KV is never served to another.

A chunk key carries
  * a fingerprint of everything that makes KV bytes compatible (model, dtype,
    layout, block and chunk size, head split, parallel layout),
  * the tenant (from vLLM's ``cache_salt``; hashed so any salt is a safe key),
  * the rank part that differs between ranks (a single shared part when ranks
    hold identical KV, e.g. MLA),
  * an optional layer id (layerwise mode),
  * the chained content hash of the chunk: vLLM's block hash of the chunk's
    last block, which already chains every earlier block (deterministic across
    processes; never Python's ``hash()``).

Text form: ``as1@{tenant}@{fingerprint}@{rank}@{layer}@{chunk_hash}``; the
tenant comes first so one tenant's keys share a prefix (remove by prefix).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Literal

KEY_VERSION = "as1"
NO_TENANT = "-"
ALL_LAYERS = "all"
_HEX = re.compile(r"[0-9a-f]+")


def _digest(data: bytes, n: int = 16) -> str:
    return hashlib.sha256(data).hexdigest()[:n]


def tenant_id(salt: str | None) -> str:
    """Stable key component for a tenant salt (``-`` for none)."""
    if not salt:
        return NO_TENANT
    return "t" + _digest(salt.encode(), 16)


@dataclass(frozen=True)
class KVFingerprint:
    """What must match for two engines' KV bytes to be interchangeable."""

    model: str
    dtype: str
    kv_layout: str  # e.g. "LBNHC"; physical order of a block's bytes
    block_size: int
    chunk_size: int
    num_layers: int
    num_kv_heads: int  # per rank
    head_size: int
    tp_size: int
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    use_mla: bool = False
    extra: str = ""  # quantisation scheme, cache role, ... anything else that changes bytes
    #: the KV cache group an object belongs to, with its spec (hybrid models: one
    #: object per chunk and group). Empty for a model with one full-attention group,
    #: whose keys are unchanged by it.
    group: str = ""

    def digest(self) -> str:
        fields = asdict(self)
        if not self.group:
            del fields["group"]
        canon = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return _digest(canon.encode(), 16)


@dataclass(frozen=True)
class RankPart:
    """The part of a key that differs between ranks."""

    head_rank: int = 0  # tp rank, or tp_rank // put_step when heads are replicated
    pp_rank: int = 0
    pcp_rank: int = 0
    dcp_rank: int = 0

    def text(self) -> str:
        return f"h{self.head_rank}p{self.pp_rank}c{self.pcp_rank}d{self.dcp_rank}"

    @classmethod
    def parse(cls, text: str) -> RankPart:
        m = re.fullmatch(r"h(\d+)p(\d+)c(\d+)d(\d+)", text)
        if not m:
            raise ValueError(f"bad rank part {text!r}")
        return cls(*(int(g) for g in m.groups()))


@dataclass(frozen=True)
class PoolKey:
    tenant: str
    fingerprint: str
    rank: RankPart
    chunk_hash: str  # lowercase hex
    layer: int | None = None

    def text(self) -> str:
        layer = ALL_LAYERS if self.layer is None else f"l{self.layer}"
        return f"{KEY_VERSION}@{self.tenant}@{self.fingerprint}@{self.rank.text()}@{layer}@{self.chunk_hash}"

    __str__ = text

    @classmethod
    def parse(cls, text: str) -> PoolKey:
        parts = text.split("@")
        if len(parts) != 6 or parts[0] != KEY_VERSION:
            raise ValueError(f"not an AscendStore chunk key: {text!r}")
        _, tenant, fp, rank, layer, chunk = parts
        if not _HEX.fullmatch(chunk) or not _HEX.fullmatch(fp):
            raise ValueError(f"not an AscendStore chunk key: {text!r}")
        if layer == ALL_LAYERS:
            layer_id = None
        elif re.fullmatch(r"l\d+", layer):
            layer_id = int(layer[1:])
        else:
            raise ValueError(f"bad layer part {layer!r} in {text!r}")
        return cls(tenant, fp, RankPart.parse(rank), chunk, layer_id)


def tenant_prefix(salt: str | None) -> str:
    """Key prefix shared by every chunk key of one tenant."""
    return f"{KEY_VERSION}@{tenant_id(salt)}@"


def block_hash_hex(block_hash: object) -> str:
    """vLLM's BlockHash is bytes (sha256 / cbor chained); older ones carry .hash_value."""
    raw = getattr(block_hash, "hash_value", block_hash)
    if isinstance(raw, bytes | bytearray | memoryview):
        return bytes(raw).hex()
    if isinstance(raw, int):
        return format(raw & ((1 << 256) - 1), "x")
    if isinstance(raw, str) and _HEX.fullmatch(raw):
        return raw
    raise TypeError(f"cannot use {type(block_hash).__name__} as a chained block hash")


def chunk_hashes(block_hashes: list[object], blocks_per_chunk: int) -> list[str]:
    """Hash of each full chunk: the chained hash of its last block."""
    n = len(block_hashes) // blocks_per_chunk
    return [block_hash_hex(block_hashes[(i + 1) * blocks_per_chunk - 1]) for i in range(n)]


# -- GR user keys -------------------------------------------------------------------
ValueType = Literal["token_id", "kv_cache"]
_UID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_TENANT = re.compile(r"[A-Za-z0-9]{1,32}")  # what tenant_id() makes ("t" + hex); "-" is no tenant
#: joins tenant and uid in a user key's first part; outside the uid alphabet, so no
#: uid of one tenant (or of none) can spell another tenant's user
TENANT_SEP = "~"


def user_part(uid: str, tenant: str = NO_TENANT) -> str:
    """First part of a user key: ``{uid}`` for no tenant, else ``{tenant}~{uid}``."""
    if not _UID.fullmatch(uid):
        raise ValueError(f"uid {uid!r} must be 1-128 chars of [A-Za-z0-9._:-]")
    if tenant == NO_TENANT:
        return uid
    if not _TENANT.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r} must be {NO_TENANT!r} or 1-32 chars of [A-Za-z0-9] "
                         "(see tenant_id)")
    return f"{tenant}{TENANT_SEP}{uid}"


def split_user_part(text: str) -> tuple[str, str]:
    """``(uid, tenant)`` of a user key's first part (inverse of ``user_part``)."""
    tenant, sep, uid = text.rpartition(TENANT_SEP)
    tenant = tenant if sep else NO_TENANT
    if user_part(uid, tenant) != text:  # validates both, rejects e.g. "-~u"
        raise ValueError(f"not a GR user part: {text!r}")
    return uid, tenant


@dataclass(frozen=True)
class UserKey:
    """``{uid}@{model}@{world_size}@{worker_id}@{value_type}[@{layer_id}]``.

    A user belongs to a tenant: with one (not ``-``) the uid part reads
    ``{tenant}~{uid}``, so the same uid under two tenants is two users."""

    uid: str
    model: str
    world_size: int
    worker_id: int
    value_type: ValueType
    layer: int | None = None
    tenant: str = NO_TENANT

    def __post_init__(self) -> None:
        user_part(self.uid, self.tenant)  # validates uid and tenant
        if "@" in self.model:
            raise ValueError(f"model name {self.model!r} must not contain '@'")
        if self.value_type not in ("token_id", "kv_cache"):
            raise ValueError(f"value_type must be token_id or kv_cache, not {self.value_type!r}")

    def text(self) -> str:
        base = (f"{user_part(self.uid, self.tenant)}@{self.model}@{self.world_size}@{self.worker_id}"
                f"@{self.value_type}")
        return base if self.layer is None else f"{base}@{self.layer}"

    __str__ = text

    @classmethod
    def parse(cls, text: str) -> UserKey:
        parts = text.split("@")
        if len(parts) not in (5, 6):
            raise ValueError(f"not a GR user key: {text!r}")
        user, model, ws, wid, vt = parts[:5]
        uid, tenant = split_user_part(user)
        layer = int(parts[5]) if len(parts) == 6 else None
        return cls(uid, model, int(ws), int(wid), vt, layer, tenant)  # type: ignore[arg-type]

    @staticmethod
    def user_prefix(uid: str, tenant: str = NO_TENANT) -> str:
        """Prefix of every key of one user of one tenant (any model and shape)."""
        return f"{user_part(uid, tenant)}@"


def model_key_name(model: str) -> str:
    """A model path/name reduced to a key-safe token (basename + short digest)."""
    base = re.sub(r"[^A-Za-z0-9._-]", "_", model.rstrip("/").split("/")[-1])[:48] or "model"
    return f"{base}.{_digest(model.encode(), 8)}"
